"""Compression (issue 8): operators, spec grammar, error feedback, CHOCO copies, the
codec in the envelope, runtime byte accounting and compressed gossip end to end."""

import asyncio
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dfl_agent.algorithms.base import get_algorithm, parse_options
from dfl_agent.algorithms.context import Message
from dfl_agent.discovery.peers import PeerTable
from dfl_agent.learning import compression as C
from dfl_agent.learning.error_feedback import ChocoGossip, ErrorFeedback
from dfl_agent.learning.training import TrainConfig
from dfl_agent.runtime.node.context import RuntimeContext
from dfl_agent.runtime.node.node import Node
from dfl_agent.runtime.shared.config import ConfigError, config_from_dict, dump_toml
from dfl_agent.transport import codec, wire
from dfl_agent.transport.memory import MemoryNetwork, run_virtual
from tests.unit.toy import toy_data as _data

FLOATS = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=40),
    elements=st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False),
)


# -- spec grammar ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, canonical",
    [("none", "none"), ("fp16", "fp16"), ("bf16", "bf16"), ("q8", "q8"), ("q4/256", "q4/256"),
     ("topk:0.01+q8", "topk:0.01+q8"), ("topk:1%+q8", "topk:0.01+q8"), ("q8+topk:0.01", "topk:0.01+q8"),
     ("randk:0.1+q8+zstd", "randk:0.1+q8+zstd"), ("topk:100", "topk:100"), ("q2+zstd:7", "q2+zstd:7"),
     ("fp32+lz4", "lz4"), ("float32", "none")],
)
def test_spec_grammar(text, canonical):
    spec = C.parse_spec(text)
    assert str(spec) == canonical
    assert C.parse_spec(str(spec)) == spec


@pytest.mark.parametrize("bad", ["q3", "topk", "topk:0", "topk:1.5", "topk:150%", "q8+q4", "zip", "fp16/8", "lz4:3", "topk:0.1+randk:0.1"])
def test_spec_errors(bad):
    with pytest.raises(C.CompressionError):
        C.parse_spec(bad)


def test_spec_kept_counts():
    assert C.parse_spec("topk:0.01").kept(10) == 1
    assert C.parse_spec("topk:0.01").kept(8192) == 82
    assert C.parse_spec("topk:100").kept(50) == 50
    assert C.parse_spec("q8").kept(7) == 7


# -- properties -------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(FLOATS, st.sampled_from(["none", "fp32+zstd", "lz4"]), st.integers(0, 2**32 - 1))
def test_lossless_round_trip(x, spec, seed):
    tensors = {"w": x, "n": np.arange(3, dtype=np.int64)}
    blob, desc, dec = C.compress_dict(tensors, spec, np.random.default_rng(seed))
    out = C.decompress_dict(blob, desc)
    for k in tensors:
        assert out[k].dtype == tensors[k].dtype
        np.testing.assert_array_equal(out[k], tensors[k])
        np.testing.assert_array_equal(dec[k], out[k])


@settings(max_examples=60, deadline=None)
@given(FLOATS, st.sampled_from([8, 4, 2]), st.sampled_from([0, 1, 7, 64]), st.integers(0, 2**32 - 1))
def test_quantization_within_one_step(x, bits, block, seed):
    spec = f"q{bits}" + (f"/{block}" if block else "")
    blob, desc, dec = C.compress_dict({"w": x}, spec, np.random.default_rng(seed))
    out = C.decompress_dict(blob, desc)["w"]
    np.testing.assert_array_equal(out, dec["w"])
    flat, got = x.reshape(-1).astype(np.float64), out.reshape(-1).astype(np.float64)
    size = flat.size if block == 0 else block
    for b in range(0, flat.size, size):
        v = flat[b : b + size]
        step = (v.max() - v.min()) / (2**bits - 1)
        tol = step * (1 + 1e-5) + 1e-6 * max(1.0, np.abs(v).max())
        assert np.all(np.abs(got[b : b + size] - v) <= tol)
        assert got[b : b + size].min() >= v.min() - tol and got[b : b + size].max() <= v.max() + tol


@settings(max_examples=30, deadline=None)
@given(FLOATS, st.sampled_from(["topk:0.1+q8", "topk:3+q4", "randk:0.2+q8", "topk:0.5+fp16", "randk:2+bf16+zstd"]),
       st.integers(0, 2**32 - 1))
def test_sparse_round_trip_and_bounds(x, spec, seed):
    s = C.parse_spec(spec)
    blob, desc, dec = C.compress_dict({"w": x}, s, np.random.default_rng(seed))
    out = C.decompress_dict(blob, desc)["w"]
    np.testing.assert_array_equal(out, dec["w"])
    kept = np.flatnonzero(out.reshape(-1))
    assert kept.size <= s.kept(x.size)
    if s.sparsifier == "topk" and s.value in ("q8", "q4"):
        assert np.abs(out).max() <= np.abs(x).max() * (1 + 1e-6) + 1e-6


def test_quantization_is_unbiased():
    rng = np.random.default_rng(0)
    x = rng.normal(size=64).astype(np.float32)
    for bits in (2, 4, 8):
        trials = 4000
        acc = np.zeros_like(x, dtype=np.float64)
        for _ in range(trials):
            levels, lo, step = C.quantize(x, bits, rng)
            acc += C.dequantize(levels, lo, step)
        step = float((x.max() - x.min()) / (2**bits - 1))
        # each draw is within one step: std <= step/2, so the mean is within 5 sigma
        assert np.abs(acc / trials - x).max() < 5 * (step / 2) / np.sqrt(trials) + 1e-6, bits


def test_fp16_and_bf16_casts():
    x = np.array([1.0, -2.5, 1e-3, 7e4, -7e4, 3.14159], np.float32)
    h = C.cast_fp16(x).astype(np.float32)
    assert np.isfinite(h).all() and h[3] == 65504 and h[4] == -65504
    b = C.uncast_bf16(C.cast_bf16(x))
    assert np.allclose(b, x, rtol=2**-8)
    assert C.uncast_bf16(C.cast_bf16(np.array([1.0], np.float32)))[0] == 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 100_000), st.floats(0.0, 1.0), st.integers(0, 2**32 - 1))
def test_indices_round_trip_and_smaller_form(n, frac, seed):
    k = max(1, int(frac * n))
    idx = np.sort(np.random.default_rng(seed).choice(n, k, replace=False)).astype(np.int64)
    mode, raw = C.encode_indices(idx, n)
    assert len(raw) <= -(-n // 8)  # never more than the bitmap
    np.testing.assert_array_equal(C.decode_indices(mode, raw, n, k), idx)


def test_topk_and_randk():
    x = np.array([0.1, -5.0, 0.2, 3.0, -0.05], np.float32)
    np.testing.assert_array_equal(C.topk_indices(x, 2), [1, 3])
    np.testing.assert_array_equal(C.random_indices(1000, 10, 42), C.random_indices(1000, 10, 42))


@pytest.mark.parametrize("mutate", [
    lambda b, d: (b[:-1], d),
    lambda b, d: (b, {**d, "t": {"w": {**d["t"]["w"], "s": [1 << 30]}}}),
    lambda b, d: (b, {**d, "c": "q3"}),
    lambda b, d: (b, {**d, "t": {"w": {**d["t"]["w"], "k": 0}}}),
    lambda b, d: (b, {**d, "t": {"w": {**d["t"]["w"], "i": "x"}}}),
    lambda b, d: (b, {**d, "t": {"w": {**d["t"]["w"], "d": "object"}}}),
    lambda b, d: (b, {"t": 3}),
    lambda b, d: (b, {**d, "z": "zstd", "zl": 5}),
])
def test_malformed_encodings_raise(mutate):
    x = np.linspace(-1, 1, 400, dtype=np.float32)
    blob, desc, _ = C.compress_dict({"w": x}, "topk:0.05+q8", np.random.default_rng(0))
    b, d = mutate(blob, desc)
    with pytest.raises(C.CompressionError):
        C.decompress_dict(b, d)


# -- error feedback and CHOCO ------------------------------------------------------------
def test_error_feedback_telescopes():
    """Σ sent + residual = Σ inputs (Stich et al. 2018: nothing is lost, only delayed)."""
    rng = np.random.default_rng(0)
    ef = ErrorFeedback("topk:0.05+q8")
    total_in = np.zeros(300)
    total_out = np.zeros(300)
    for _ in range(20):
        g = rng.normal(size=300).astype(np.float32)
        _, _, dec = ef.compress("peer", {"g": g}, rng)
        total_in += g
        total_out += dec["g"]
    np.testing.assert_allclose(total_out + ef.residuals["peer"]["g"], total_in, atol=1e-3)


def _gossip(spec, ef, iters, n=5, d=400):
    rng = np.random.default_rng(1)
    xs = [{"w": rng.normal(size=d).astype(np.float32)} for _ in range(n)]
    mean0 = np.mean([x["w"] for x in xs], axis=0)
    nodes = [ChocoGossip(spec, np.random.default_rng(i), error_feedback=ef) for i in range(n)]
    for _ in range(iters):
        sent = []
        for i in range(n):
            blob, desc, meta = nodes[i].outgoing(xs[i])
            sent.append((C.decompress_dict(blob, desc), meta))
        new = []
        for i in range(n):
            copies = [nodes[i].own_copy()] + [nodes[i].incoming(f"n{j}", *sent[j]) for j in range(n) if j != i]
            new.append(nodes[i].mix(xs[i], {"w": np.mean([c["w"] for c in copies], axis=0)}))
        xs = new
    return float(np.mean([np.linalg.norm(x["w"] - mean0) for x in xs]) / np.linalg.norm(mean0))


def test_choco_gossip_reaches_consensus_only_with_error_feedback():
    assert _gossip("q8", True, 20) < 1e-3
    with_ef = _gossip("topk:0.1+q8", True, 150)
    without = _gossip("topk:0.1+q8", False, 150)
    assert with_ef < 0.01 and without > 10 * with_ef


def test_choco_gap_waits_for_keyframe():
    a = ChocoGossip("topk:0.5+q8", np.random.default_rng(0), keyframe_every=3)
    b = ChocoGossip("topk:0.5+q8", np.random.default_rng(1))
    x = {"w": np.ones(10, np.float32)}
    msgs = [a.outgoing({"w": x["w"] * (i + 1)}) for i in range(4)]  # seq 0 (key), 1, 2, 3 (key)
    dec = [(C.decompress_dict(bl, de), me) for bl, de, me in msgs]
    assert b.incoming("a", *dec[0]) is not None
    assert b.incoming("a", *dec[2]) is None and b.gaps == 1  # seq 1 missed
    got = b.incoming("a", *dec[3])  # keyframe
    np.testing.assert_array_equal(got["w"], a.own_copy()["w"])


def test_sparsified_streams_resend_keyframes_by_default():
    from dfl_agent.learning.error_feedback import SPARSE_KEYFRAME_EVERY

    def keys(spec: str, every: int, n: int) -> list[int]:
        a = ChocoGossip(spec, np.random.default_rng(0), keyframe_every=every)
        return [i for i in range(n) if a.outgoing({"w": np.full(20, i, np.float32)})[2]["choco"][1]]

    n = 2 * SPARSE_KEYFRAME_EVERY + 1
    assert keys("topk:0.1+q8", 0, n) == [0, SPARSE_KEYFRAME_EVERY, 2 * SPARSE_KEYFRAME_EVERY]
    assert keys("q8", 0, n) == [0]  # dense: the copies converge geometrically, first message only
    assert keys("topk:0.1+q8", -1, n) == [0]  # explicitly first only
    assert keys("topk:0.1+q8", 7, 15) == [0, 7, 14]


# -- wire, runtime, config -----------------------------------------------------------------
def test_envelope_describes_encoding():
    x = {"w": np.linspace(-1, 1, 1000, dtype=np.float32).reshape(10, 100), "n": np.array([7], np.int64)}
    wt, desc, dec = codec.encode_tensors(x, "topk:0.1+q4+zstd", np.random.default_rng(0))
    frame = wire.encode(Message("m", 1, wt, encoding=desc), federation="f", sender="a")
    msg = wire.decode(frame)
    assert msg.encoding == desc and set(msg.tensors) == {"w", "n"}
    np.testing.assert_array_equal(msg.tensors["w"], dec["w"])
    assert msg.tensors["n"][0] == 7
    bad = dict(desc, t={"w": {"s": [10, 100], "k": 5000, "i": "v", "il": 3}})
    with pytest.raises(wire.WireError) as e:
        wire.decode(wire.encode(Message("m", 1, wt, encoding=bad), federation="f", sender="a"))
    assert e.value.reason == "bad_encoding"


def _ctx(net, nid, policy):
    return RuntimeContext(
        node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"), data=None,
        model_spec={}, train=None, init_seed=0, rng=np.random.default_rng(0), compression=policy,
    )


def test_runtime_compresses_per_kind_and_counts_bytes():
    policy = C.CompressionPolicy.from_config("topk:0.1+q8", {"grad": "topk:0.1+q8"})
    net = MemoryNetwork()
    a, b = _ctx(net, "a", policy), _ctx(net, "b", None)
    w = np.random.default_rng(0).normal(size=(50, 40)).astype(np.float32)

    async def main():
        await a.start()
        await b.start()
        await asyncio.sleep(0)
        n_model = await a.send("b", Message("model", 0, {"w": w}))
        n_grad = await a.send("b", Message("grad", 0, {"w": w}))
        n_vote = await a.send("b", Message("vote", 0, meta={"ok": True}))
        got_model = await b.receive("model", deadline=1.0)
        got_grad = await b.receive("grad", deadline=1.0)
        await a.end_round(0)
        return n_model, n_grad, n_vote, got_model, got_grad

    n_model, n_grad, n_vote, m, g = run_virtual(main())
    # whole-model kind: value coder only (q8, dense); the listed kind: sparsified with a residual
    assert np.count_nonzero(m.tensors["w"]) > 0.9 * w.size and np.abs(m.tensors["w"] - w).max() < 0.1
    assert np.count_nonzero(g.tensors["w"]) <= 200 and n_grad < n_model < w.nbytes
    assert "b" in a.outbox.error_feedback["grad"].residuals
    acc = a.byte_accounting()
    assert acc["bytes_sent_by_kind"] == {"model": n_model, "grad": n_grad, "vote": n_vote}
    assert acc["round_bytes_sent"] == n_model + n_grad + n_vote
    assert acc["compression_ratio"] > 1.5


def test_config_section():
    cfg = config_from_dict({"compression": {"spec": "q8", "kinds": {"gt.grad": "topk:0.01+q8"}}})
    p = cfg.compression.policy()
    assert str(p.message_spec("dfml.model")) == "q8" and str(p.message_spec("gt.grad")) == "topk:0.01+q8"
    assert config_from_dict({"compression": {"spec": "none"}}).compression.policy() is None  # off
    assert str(config_from_dict({}).compression.policy().default) == "q4+zstd"  # the shipped default
    import tomllib

    assert config_from_dict(tomllib.loads(dump_toml(cfg))).compression == cfg.compression
    with pytest.raises(ConfigError, match="compression.kinds.x"):
        config_from_dict({"compression": {"kinds": {"x": "q9"}}})
    with pytest.raises(ConfigError, match="compression.spec"):
        config_from_dict({"compression": {"spec": "topk"}})


# -- compressed gossip end to end ---------------------------------------------------------------
SPEC = {"type": "mlp", "input_shape": [4], "hidden": [64, 32], "num_classes": 2}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models on a shared machine: one intra-op thread is much faster."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _federation(algorithm, spec, n=3, rounds=3):
    net = MemoryNetwork()
    cls = get_algorithm(algorithm)
    opts = parse_options(cls, {"round_timeout": 5.0})
    policy = C.CompressionPolicy.from_config(spec)
    test = _data(99, 64)
    nodes = []
    for i in range(n):
        nid = f"n{i}"
        ctx = RuntimeContext(
            node_id=nid, federation="f", transport=net.transport(nid, "f"), peers=PeerTable(nid, "f"),
            data=_data(i), model_spec=SPEC, train=TrainConfig(batch_size=8, lr=0.1), init_seed=i,
            rng=np.random.default_rng(i), compression=policy if policy.active else None,
        )
        nodes.append(Node(ctx, cls(ctx, opts), test.train_x, test.train_y))

    async def main():
        for node in nodes:
            await node.ctx.start()
            await node.setup()
        await asyncio.gather(*(node.run(rounds) for node in nodes))

    run_virtual(main())
    return nodes


@pytest.mark.parametrize("algorithm, spec, ratio", [
    ("fedavg", "q8", 3.0), ("fedavg", "topk:0.1+q8", 3.0), ("dechw", "topk:0.1+q8", 3.0),
    ("cfa", "q4", 4.0), ("dechetero", "fp16", 1.7),
])
def test_compressed_gossip_runs_and_saves_bytes(algorithm, spec, ratio):
    nodes = _federation(algorithm, spec)
    for node in nodes:
        assert node.history[-1]["round"] == 3 and node.history[-1]["neighbours"] == 2
        assert sum(node.ctx.counters()["dropped"].values()) == 0
        assert np.isfinite(node.history[-1]["train_loss"])
        assert node.status()["compression_ratio"] > ratio
        assert "round_bytes_sent_by_kind" in node.history[-1]


def test_uncompressed_node_rejects_choco_differences():
    """A node without compression never averages in a CHOCO difference as a model."""
    from dfl_agent.algorithms import gossip_compression as gc

    choco = ChocoGossip("q8", np.random.default_rng(0))
    m = gc.model_message(choco, "model", 0, {"w": np.ones(4, np.float32)}, {"samples": 1})
    m.sender = "x"
    rejected = []
    ctx = types.SimpleNamespace(reject=lambda msg, reason: rejected.append(reason))
    assert gc.received_copies(ctx, None, {"x": m}) == {}
    assert rejected[0].startswith("compressed_stream")


def test_zstd_frame_that_declares_a_huge_size_is_refused_before_allocating():
    from dfl_agent.learning.compression import CompressionError, zstd_inflate

    liar = bytes([0x28, 0xB5, 0x2F, 0xFD, 0xE0]) + (1 << 62).to_bytes(8, "little") + bytes([0x11, 0, 0]) + b"{}"
    with pytest.raises(CompressionError, match="declares"):
        zstd_inflate(liar, 1000)
    with pytest.raises(CompressionError):
        zstd_inflate(b"not zstd", 1000)
    import zstandard

    assert zstd_inflate(zstandard.ZstdCompressor().compress(b"abc" * 10), 30) == b"abc" * 10
    with pytest.raises(CompressionError):
        zstd_inflate(zstandard.ZstdCompressor().compress(b"abc" * 10), 29)
