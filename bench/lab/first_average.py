"""Offline, from accumulation lab folders: what the first average of a warm-started run does
to each device's validation slice, with and without the output-layer fit.

For each device of each folder (``dflctl lab run bench/lab/scenarios/accumulation.toml --out
DIR``): the version the first run deployed (``models/v1``, the second run's start) and the
store as the lab left it (full before the second run began). On the device's validation slice
(the deploy gate's, a fifth of the store):

- ``v1``: the start version;
- ``mean``: the plain mean of the four devices' start versions (FedAvg's first average,
  equal weights: the stores are the same size), without a fit;
- ``own fit``: the device's version after the agent's fit (:func:`linear_probe` on the
  store's training part);
- ``mean of fits``: the mean of the four fitted versions;
- ``own rows`` / ``mean of rows fits``: the same with only the unlearned classes' rows (and
  biases) fitted, the known rows kept.

It leaves out round 1's local training (at a tenth of the rate under the ramp).

Usage: python bench/lab/first_average.py DIR [DIR ...] > bench/lab/results/accumulation/first_average.md
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dfl_agent.learning import probe as P
from dfl_agent.learning.params import load_numpy, model_to_numpy
from dfl_agent.models.deployed import load_deployed
from dfl_agent.store.sqlite import SampleStore, validation_mask


def fit_rows(model: nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray] | None:
    """The output layer with only the unlearned classes' rows fitted (as :func:`linear_probe`
    does the whole layer: its steps, its two rates, the lower cross-entropy kept)."""
    found = P.output_layer(model)
    assert found is not None
    name, layer = found
    h, preds = P._features(model, layer, x)
    assert preds is not None
    unlearned = sorted(set(np.unique(y).tolist()) - set(np.unique(preds).tolist()))
    if not unlearned:
        return None
    target = torch.from_numpy(y.astype(np.int64))
    w0, b0 = layer.weight.detach().float().clone(), layer.bias.detach().float().clone()
    rows = torch.zeros(w0.shape[0], dtype=torch.bool)
    rows[unlearned] = True
    best = None
    for lr in (P.LR, P.step_size(h)):
        w, b = P._fit(h, target, w0, b0, lr, rows)
        assert b is not None
        loss = P._loss(h, target, w, b)
        if best is None or loss < best[0]:
            best = (loss, w, b)
    assert best is not None
    return {f"{name}.weight": best[1].numpy(), f"{name}.bias": best[2].numpy()}


def _with(model: nn.Module, state: dict[str, np.ndarray] | None) -> nn.Module:
    out = copy.deepcopy(model)
    if state:
        load_numpy(out, {**model_to_numpy(out), **state})
    return out


def _mean(models: list[nn.Module]) -> nn.Module:
    states = [model_to_numpy(m) for m in models]
    return _with(models[0], {k: np.mean([s[k] for s in states], axis=0).astype(states[0][k].dtype) for k in states[0]})


def _acc(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("`python bench/lab/first_average.py " + " ".join(d.name for d in a.dirs) + "`\n")
    print("| lab folder | device | v1 | mean | own fit | mean of fits | own rows fit | mean of rows fits |")
    print("|---|---|---|---|---|---|---|---|")
    for lab in a.dirs:
        devs = []
        for dev in sorted((lab / "devices").iterdir()):
            store = SampleStore(dev / "state", create=False)
            try:
                sid, x, y, _ = store.load(store.snapshot())
            finally:
                store.close()
            val = validation_mask(sid, 0.2)
            v1 = load_deployed(dev / "state" / "models" / "v1")
            fit = _with(v1, P.linear_probe(v1, x[~val], y[~val]).state)
            rows = _with(v1, fit_rows(v1, x[~val], y[~val]))
            devs.append((dev.name, v1, fit, rows, x[val], y[val]))
        means = [_mean([d[i] for d in devs]) for i in (1, 2, 3)]
        for name, v1, fit, rows, xv, yv in devs:
            accs = [_acc(m, xv, yv) for m in (v1, means[0], fit, means[1], rows, means[2])]
            print(f"| {lab.name} | {name} | " + " | ".join(f"{v:.3f}" for v in accs) + " |")


if __name__ == "__main__":
    main()
