"""Where a run process's memory goes: the work of a run on the HAR default model, phase by phase,
in one process, with its peak RSS (``getrusage`` ``ru_maxrss``) and its current RSS after each.

Phases: ``import torch`` (one thread, as the default profile sets), the agent's modules, the
model (the HAR default: ``cnn1d`` 16-32-64), ``--rounds`` rounds of local training (1 epoch over
``--windows`` random 3 x 128 windows, batch 32, momentum 0.9) each followed by an evaluation of
the same windows (batch 512, the node's default), importing onnx and onnxruntime, and the deploy
gate's export (``export_checked`` on 64 windows).  ``--torch-optim`` trains with
``torch.optim.SGD`` (what the agent did before ``PlainSGD``); the allocator is glibc's, set through
its environment variables (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, ...), which the line
records.  ``train_eval_cpu_s``: the CPU seconds of the rounds (training and evaluation).
Appends one JSON line to ``--out``.

    for env in X=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=1048576; do
      env $env .venv/bin/python bench/operations/run_peak_steps.py --label "$env"; done
    .venv/bin/python bench/operations/run_peak_steps.py --torch-optim --label torch.optim.SGD
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

MB = 2**20


def rss_now() -> float:
    """The current resident set size (MiB), from /proc/self/statm."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def peak() -> float:
    """The peak resident set size so far (MiB; ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=3200, help="training windows (3 x 128)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of training and evaluation")
    p.add_argument("--torch-optim", action="store_true", help="train with torch.optim.SGD")
    p.add_argument("--label", default="", help="what this measures")
    p.add_argument("--out", default="bench/operations/run_peak_steps.jsonl", help="JSON lines to append to")
    a = p.parse_args()
    phases: list[dict[str, object]] = []

    def mark(name: str) -> None:
        phases.append({"phase": name, "peak_mb": round(peak(), 1), "rss_mb": round(rss_now(), 1),
                       "modules": len(sys.modules)})

    mark("python")
    import torch

    torch.set_num_threads(1)
    mark("import torch")
    import numpy as np

    import dfl_agent.runtime.run.agent  # noqa: F401 - the run process's modules
    from dfl_agent.learning import training
    from dfl_agent.learning.training import TrainConfig, evaluate, train_local
    from dfl_agent.models import build_model

    mark("the agent's modules")
    spec = {"type": "cnn1d", "in_channels": 3, "length": 128, "channels": [16, 32, 64], "kernel": 5,
            "num_classes": 6, "norm": "layer"}
    model = build_model(spec)
    mark("model")
    if a.torch_optim:  # the optimizer every training used before PlainSGD
        real = training.make_optimizer
        training.make_optimizer = lambda *args, **kw: real(*args, **{**kw, "torch_api": True})  # type: ignore[assignment]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(a.windows, 3, 128)).astype(np.float32)
    y = rng.integers(0, 6, a.windows)
    cfg = TrainConfig(epochs=1, batch_size=32, lr=0.05, momentum=0.9)
    t0 = time.process_time()
    for r in range(1, a.rounds + 1):
        train_local(model, x, y, cfg, rng=rng)
        mark(f"round {r}: training")
        evaluate(model, x, y)
        mark(f"round {r}: evaluation")
    cpu = time.process_time() - t0
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401

    mark("import onnx, onnxruntime")
    from dfl_agent.models.onnx_export import export_checked

    export_checked(model, (3, 128), x[:64], spec=spec)
    mark("export and check (64 windows)")
    env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    from idle import commit, machine
    from runs_timing import invocation

    rec = {"label": a.label, "command": invocation(), "commit": commit(), "machine": machine(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "allocator_env": env, "torch_optim": a.torch_optim,
           "windows": a.windows, "torch._dynamo imported": "torch._dynamo" in sys.modules,
           "train_eval_cpu_s": round(cpu, 2), "peak_mb": round(peak(), 1), "phases": phases}
    with open(a.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "phases"}))
    print("  ".join(f"{ph['phase']}: {ph['peak_mb']}/{ph['rss_mb']}" for ph in phases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
