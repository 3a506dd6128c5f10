"""``build_node``: one node's assembly, the same in the simulator and on a device: its
complete context, the algorithm bound to it, and the :class:`~dfl_agent.runtime.node.node.Node`."""

from __future__ import annotations

from typing import Any

import numpy as np

from dfl_agent.algorithms.base import Algorithm
from dfl_agent.runtime.node.node import MetricsSink, Node
from dfl_agent.runtime.node.node_hooks import NodeHooks


def build_node(algo_cls: type[Algorithm], options: Any, *, model_spec: dict[str, Any], test_x: np.ndarray, test_y: np.ndarray,
               baseline_local: bool = False, sink: MetricsSink | None = None, rounds: int = 0, eval_every: int = 1,
               eval_background: bool = False, hooks: NodeHooks | None = None, accuracy_source: str | None = None,
               run_info: dict[str, Any] | None = None, lr_ramp: int = 0, **context: Any) -> Node:
    """One node: its complete :class:`~dfl_agent.runtime.node.context.RuntimeContext` (built
    with every setting, nothing assigned afterwards), the algorithm bound to it, and the
    :class:`~dfl_agent.runtime.node.node.Node` that runs and reports it.

    The peer-compatibility rule (which peers' models can take part) comes from the
    algorithm and ``model_spec`` (:func:`dfl_agent.profiles.peer_incompatibility`), the
    same in both worlds.

    Args:
        algo_cls, options: from :func:`resolve_algorithm` (or the simulator's registry lookup).
        model_spec: the node's model (:func:`choose_model_specs`).
        test_x, test_y: the global test set (float32 ``(N, *shape)``, int64 ``(N,)``).
        baseline_local, sink, rounds, eval_every, eval_background, hooks, accuracy_source,
            run_info, lr_ramp: the :class:`~dfl_agent.runtime.node.node.Node`'s.
        context: the :class:`~dfl_agent.runtime.node.context.RuntimeContext`'s keyword arguments
            (``node_id``, ``federation``, ``transport``, ``peers``, ``data``, ``train``, ...).

    Raises:
        ValueError: from the algorithm's constructor (options it cannot run with).
    """
    from dfl_agent.models import spec_hash
    from dfl_agent.profiles import peer_incompatibility
    from dfl_agent.runtime.node.context import RuntimeContext

    ctx = RuntimeContext(model_spec=model_spec, compatibility=peer_incompatibility(algo_cls.name, spec_hash(model_spec)),
                         **context)
    return Node(ctx, algo_cls(ctx, options), test_x, test_y, baseline_local=baseline_local, sink=sink,
                rounds=rounds, eval_every=eval_every, eval_background=eval_background, hooks=hooks,
                accuracy_source=accuracy_source, run_info=run_info, lr_ramp=lr_ramp)
