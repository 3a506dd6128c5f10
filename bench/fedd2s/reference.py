"""Centralized reference of FedD2S: the seed's server-based Algorithm 1 (seed 002), features
sent to the server.

This is the paper as printed (with ALGORITHMS.md's decisions), used to check that the
serverless ``fedd2s`` (:mod:`dfl_agent.algorithms.fedd2s`) computes the same thing:

- each round the *server* draws ⌈ρN⌉ clients (:func:`dfl_agent.algorithms.protocols.rotating.draw_round`,
  the same generator as the serverless token holder);
- each selected *client* sets l_n by Eq. 6 and transmits its triplets (H_1, H_{l_n}, Y)
  — activations and labels — to the server (Alg. 1 lines 5–10);
- the server distils each client's triplets into a copy θ^{g,n} of θ^g (Eq. 8–10),
  averages the copies (Eq. 11), computes t^n = F(H_1^n; θ^g_{+1}) and sends t^n with the
  head θ^g_{+l_n} back to client n (lines 18–23; the head's parameters are needed to
  back-propagate Eq. 12 through it);
- each client runs server-to-client distillation (Eq. 12–13) on its personal model.

Same seed and data -> the same personal models as the serverless variant (unit test
``tests/unit/test_fedd2s.py``), within float tolerance.  The simulator's data preparation
is reused by :func:`simulate_reference`, which writes nothing and returns a summary with
the user accuracy (UA).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from dfl_agent.algorithms.fedd2s import FedD2SOptions, resolve_l_min
from dfl_agent.algorithms.protocols.rotating import draw_round, global_init_seed
from dfl_agent.data import NodeData
from dfl_agent.learning import d2s
from dfl_agent.learning.params import model_to_numpy
from dfl_agent.learning.training import adam_lr, evaluate
from dfl_agent.models import build_model


def _build(spec: Mapping[str, Any], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(spec)


class ReferenceClient:
    """A client of Algorithm 1: personal model θ^n, participation count Z_n."""

    def __init__(self, node_id: str, data: NodeData, spec: Mapping[str, Any], init_seed: int,
                 options: FedD2SOptions, batch_size: int, device: str = "cpu"):
        self.node_id, self.data, self.spec, self.o = node_id, data, spec, options
        self.personal = _build(spec, init_seed).to(device)
        self.L = d2s.num_layers(self.personal)
        self.l_min = resolve_l_min(list(cast("list[str]", self.personal.layer_names)), list(options.dropping_set))
        self.batch_size, self.device = batch_size, device
        self.z, self.l = 0, self.L

    def extract(self) -> tuple[int, list]:
        """Eq. 6 and local knowledge extraction: returns (l_n, triplets) for the server."""
        self.z += 1
        self.l = d2s.distillation_layer(self.z, self.L, self.o.z0, self.l_min)
        return self.l, d2s.extract_features(self.personal, self.data.train_x, self.data.train_y, self.l,
                                            self.batch_size, self.device)

    def distil(self, targets: list[torch.Tensor], head_state: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Server-to-client distillation (Eq. 12–13) with the server's t^n and head θ^g_{+l}."""
        head_model = _build(self.spec, 0).to(self.device)
        head_model.load_state_dict(dict(head_state), strict=False)
        return d2s.s2c_distill(self.personal, head_model, self.data.train_x, self.data.train_y, targets, self.l,
                               self.batch_size, lr=adam_lr(self.o.adam_lr, None), epochs=self.o.s2c_epochs,
                               temperature=self.o.temperature, device=self.device)


class ReferenceServer:
    """The server of Algorithm 1, holding θ^g and receiving the clients' features."""

    def __init__(self, spec: Mapping[str, Any], seed: int, options: FedD2SOptions, device: str = "cpu"):
        self.o, self.seed = options, seed
        self.global_model = _build(spec, global_init_seed(seed)).to(device)
        self.bytes_received = 0  # features + labels received (float32 / int64 sizes)

    def round(self, t: int, clients: dict[str, ReferenceClient]) -> list[str]:
        """Run round ``t`` over ``clients`` (id -> client); returns the participants."""
        selected, _ = draw_round(self.seed, t, list(clients), self.o.sender_ratio)
        uploads = {n: clients[n].extract() for n in selected}  # "transmit all triplets to the server"
        for _l, trip in uploads.values():
            self.bytes_received += sum(h1.numel() * 4 + hl.numel() * 4 + y.numel() * 8 for h1, hl, y in trip)
        copies = {}
        for n in selected:  # C2S on the server (Eq. 8-10)
            l, trip = uploads[n]
            g = copy.deepcopy(self.global_model)
            d2s.c2s_distill(g, trip, l, lr=adam_lr(self.o.adam_lr, None), epochs=self.o.c2s_epochs, temperature=self.o.temperature)
            copies[n] = model_to_numpy(g)
        avg = d2s.average_states([copies[n] for n in sorted(selected)])  # Eq. 11
        self.global_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in avg.items()})
        for n in selected:  # global knowledge extraction, transmitted back with the head
            l, trip = uploads[n]
            targets = d2s.global_soft_targets(self.global_model, [h1 for h1, _, _ in trip])
            head_state = {k: v.detach().clone() for k, v in self.global_model.state_dict().items()
                          if k.startswith("blocks.") and int(k.split(".")[1]) >= l}
            clients[n].distil(targets, head_state)
        return selected


@dataclasses.dataclass
class ReferenceResult:
    """Personal models (id -> model), the final global model and per-round records."""

    personal: dict[str, nn.Module]
    global_model: nn.Module
    history: dict[str, list[dict[str, Any]]]
    participants: list[list[str]]
    server_bytes_received: int


def run_reference(datas: Mapping[str, NodeData], spec: Mapping[str, Any], options: FedD2SOptions, *, seed: int,
                  init_seeds: Mapping[str, int], rounds: int, batch_size: int, device: str = "cpu",
                  evaluate_every: int = 0) -> ReferenceResult:
    """Run Algorithm 1 for ``rounds`` rounds.

    Args:
        datas: node id -> its data (train split for training, val split for UA).
        init_seeds: node id -> torch seed of its personal model (as ``NodeContext.init_seed``).
        evaluate_every: record each node's ``local_accuracy`` (UA) every this many rounds
            (and the last); 0 = never.
    """
    clients = {n: ReferenceClient(n, datas[n], spec, init_seeds[n], options, batch_size, device)
               for n in sorted(datas)}
    server = ReferenceServer(spec, seed, options, device)
    history: dict[str, list[dict[str, Any]]] = {n: [] for n in clients}
    parts = []
    for t in range(1, rounds + 1):
        parts.append(server.round(t, clients))
        if evaluate_every and (t % evaluate_every == 0 or t == rounds):
            for n, c in clients.items():
                acc = evaluate(c.personal, c.data.val_x, c.data.val_y, device=device)["accuracy"]
                history[n].append({"node": n, "round": t, "local_accuracy": acc, "z": c.z, "l": c.l})
    return ReferenceResult({n: c.personal for n, c in clients.items()}, server.global_model, history, parts,
                           server.bytes_received)


def simulate_reference(cfg: Any) -> dict[str, Any]:
    """The reference on a :class:`dfl_agent.runtime.node.simulator.SimConfig` (same data, seeds and
    model as ``simulate(cfg)`` with ``algorithm = "fedd2s"``); returns a small summary with
    ``user_accuracy`` (see :func:`dfl_agent.runtime.node.metrics.user_accuracy`)."""
    from dfl_agent.algorithms.base import get_algorithm, parse_options
    from dfl_agent.data import load_dataset, make_node_data, partition
    from dfl_agent.models import validate_spec
    from dfl_agent.runtime.node import metrics
    from dfl_agent.runtime.node.node import init_seed_for
    from dfl_agent.runtime.node.simulator import node_name

    started = time.time()
    options = parse_options(get_algorithm("fedd2s"), cfg.options)
    bundle = load_dataset(cfg.dataset, path=cfg.dataset_path, cache_dir=cfg.cache_dir)
    parts = partition(bundle.pool, cfg.nodes, cfg.partition, seed=cfg.seed, beta=cfg.beta, zeta=cfg.zeta)
    spec = validate_spec(cfg.model_spec)
    datas = {node_name(i): make_node_data(bundle, parts[i], seed=cfg.seed) for i in range(cfg.nodes)}
    seeds = {node_name(i): init_seed_for(cfg.seed, i, cfg.init) for i in range(cfg.nodes)}
    prev = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        res = run_reference(datas, spec, options, seed=cfg.seed, init_seeds=seeds, rounds=cfg.rounds,
                            batch_size=options.distill_batch_size or cfg.train.batch_size, evaluate_every=cfg.eval_every)
    finally:
        torch.set_num_threads(prev)
    return {"algorithm": "fedd2s-reference", "nodes": cfg.nodes, "rounds_completed": cfg.rounds,
            "user_accuracy": metrics.user_accuracy(res.history), "server_bytes_received": res.server_bytes_received,
            "wall_seconds": time.time() - started}


def personal_states(models: Mapping[str, nn.Module]) -> dict[str, dict[str, np.ndarray]]:
    """``{node: state as numpy}`` (for comparisons)."""
    return {n: model_to_numpy(m) for n, m in models.items()}
