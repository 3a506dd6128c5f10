"""Bytes of one model message (envelope included) per spec and model size: where the
fixed envelope stops mattering.  `fp32` is float32 sent through the codec (the same
compact envelope as q8: raw blob, one table) - the strictest float32 reference.  Usage: .venv/bin/python bench/compression/frame_sizes.py"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def main() -> None:
    from dfl_agent.algorithms.context import Message
    from dfl_agent.learning.params import model_to_numpy
    from dfl_agent.models import build_model, default_spec
    from dfl_agent.transport import codec, wire

    rng = np.random.default_rng(0)
    print("| dataset | model size | parameters | spec | frame bytes | × fewer than float32 | × fewer than `fp32` frame |")
    print("|---|---|---|---|---|---|---|")
    for ds, shape, classes in (("digits", [1, 8, 8], 10), ("har", [3, 128], 6)):
        for size in ("small", "medium", "large"):
            tensors = model_to_numpy(build_model(default_spec(shape, classes, size)))
            n = sum(a.size for a in tensors.values())
            f32 = len(wire.encode(Message("model", 1, tensors, meta={"samples": 100}), federation="sim", sender="node00"))
            frames = {}
            for spec in ("none", "fp32", "fp16", "q8", "q4", "topk:0.1+q8", "topk:0.01+q8"):
                if spec == "none":
                    size_b = f32
                else:
                    wt, desc, _ = codec.encode_tensors(tensors, spec, rng)
                    msg = Message("model", 1, wt, meta={"samples": 100, "choco": [1, 0]}, encoding=desc)
                    size_b = len(wire.encode(msg, federation="sim", sender="node00"))
                frames[spec] = size_b
                print(f"| {ds} | {size} | {n} | `{spec}` | {size_b} | {f32 / size_b:.2f} | {frames.get('fp32', f32) / size_b:.2f} |")


if __name__ == "__main__":
    main()
