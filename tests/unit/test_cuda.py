"""CUDA on a real GPU: device selection, the training step against the cpu step (TF32 off),
AMP on and off, evaluation, the batched step against the per-node loop, checkpoints
across devices (CUDA -> cpu -> CUDA), the ONNX export of a CUDA-trained model and the
simulator on CUDA against cpu.

Marked ``cuda``: skipped, with the reason, where torch sees no CUDA device (CI).
``scripts/gpu_check.sh`` runs them on a GPU machine.  ``DFL_CUDA_TESTS_ON_CPU=1`` runs
their logic with ``cpu`` in place of the GPU (a check of the tests themselves, not of
CUDA; the CUDA-only assertions then skip).
"""

from __future__ import annotations

import asyncio
import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dfl_agent.algorithms.base import get_algorithm, parse_options  # noqa: E402
from dfl_agent.data import load_dataset, node_data_for  # noqa: E402
from dfl_agent.discovery.peers import PeerTable  # noqa: E402
from dfl_agent.learning.training import TrainConfig, autocast_for, evaluate, round_batches, train_local  # noqa: E402
from dfl_agent.models import build_model, default_spec, spec_hash  # noqa: E402
from dfl_agent.runtime.node.batching import evaluate_group, train_group  # noqa: E402
from dfl_agent.runtime.node.checkpoint import CheckpointStore, NodeCheckpointer  # noqa: E402
from dfl_agent.runtime.node.context import RuntimeContext  # noqa: E402
from dfl_agent.runtime.node.node import Node  # noqa: E402
from dfl_agent.transport.memory import MemoryNetwork, run_virtual  # noqa: E402

ON_CPU = os.environ.get("DFL_CUDA_TESTS_ON_CPU") == "1"
HAVE_CUDA = torch.cuda.is_available()
#: the device under test
DEV = "cuda:0" if HAVE_CUDA and not ON_CPU else "cpu"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (HAVE_CUDA or ON_CPU),
                       reason="no CUDA device: torch.cuda.is_available() is False "
                              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                              "scripts/gpu_check.sh runs these on a GPU machine"),
]

needs_real_cuda = pytest.mark.skipif(ON_CPU, reason="DFL_CUDA_TESTS_ON_CPU=1: a CUDA-only assertion")

#: a conv model (cuDNN) and the default MLP, both on digits' (1, 8, 8) inputs
CONV = {"type": "convdense", "input_shape": [1, 8, 8], "conv": [4, 8, 8], "dense": [16, 16], "num_classes": 10}
RTOL = 1e-4


@pytest.fixture(autouse=True)
def no_tf32():
    """Exact float32 matrix products and convolutions on the GPU (TF32 rounds to 10 bits)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _model(spec, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(spec)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (both brought to cpu float64)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _assert_params_close(got, want, rtol=RTOL):
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
        assert _rel(p, q) <= rtol, f"{n}: relative difference {_rel(p, q):.3g} > {rtol:g}"


# -- device selection ---------------------------------------------------------------------

@needs_real_cuda
def test_device_selection_on_the_real_gpu():
    from dfl_agent.profiles import get_profile, resolve_device, select_behaviour
    from dfl_agent.profiles.detect import cuda_devices, detect
    from dfl_agent.runtime.node.simulator import check_device

    n = torch.cuda.device_count()
    assert resolve_device("auto")[0] == "cuda:0"
    assert resolve_device("cuda")[0] == "cuda:0"
    assert resolve_device(f"cuda:{n}")[0] == "cpu"  # an index torch does not see: cpu, with the reason
    assert resolve_device("cpu")[0] == "cpu"
    has_torch, devices = cuda_devices()
    assert has_torch and len(devices) == n
    assert devices[0].name == torch.cuda.get_device_name(0)
    assert devices[0].memory_mb == torch.cuda.get_device_properties(0).total_memory // 2**20
    det = detect()
    assert det.profile.match.cuda is True, det.to_dict()  # a CUDA profile (generic-cuda on x86-64)
    b = select_behaviour(get_profile("generic-cuda"), "fedavg")
    assert b.device == "cuda:0" and b.mixed_precision
    assert check_device("cuda") == "cuda:0"
    with pytest.raises(ValueError, match="CUDA device"):
        check_device(f"cuda:{n}")


# -- the training step ----------------------------------------------------------------------

@pytest.mark.parametrize("spec_name", ["mlp", "conv"])
def test_training_step_on_cuda_equals_the_cpu_step(digits, spec_name):
    spec = CONV if spec_name == "conv" else default_spec((1, 8, 8), 10, "small")
    x, y = digits.pool.x[:256], digits.pool.y[:256]
    cfg = TrainConfig(epochs=2, batch_size=32, lr=0.05, momentum=0.9, weight_decay=1e-4)
    cpu, gpu = _model(spec), _model(spec).to(DEV)
    a = train_local(cpu, x, y, cfg, np.random.default_rng(3), "cpu")
    b = train_local(gpu, x, y, cfg, np.random.default_rng(3), DEV)
    assert next(gpu.parameters()).device.type == torch.device(DEV).type
    assert b["samples"] == a["samples"] and b["diverged"] == a["diverged"] == 0.0
    assert abs(b["loss"] - a["loss"]) <= RTOL * abs(a["loss"])
    _assert_params_close(gpu, cpu)
    assert _rel(next(gpu.parameters()), next(_model(spec).parameters())) > 1e-3  # it did train


@needs_real_cuda
def test_amp_on_and_off(digits):
    spec = CONV
    x, y = digits.pool.x[:512], digits.pool.y[:512]
    dtypes: dict[bool, set[torch.dtype]] = {}
    models = {}
    for amp in (False, True):
        m = _model(spec).to(DEV)
        seen: set[torch.dtype] = set()
        hooks = [mod.register_forward_hook(lambda _m, _i, out, s=seen: s.add(out.dtype))
                 for mod in m.modules() if isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d))]
        cfg = TrainConfig(epochs=3, batch_size=32, lr=0.05, mixed_precision=amp)
        stats = train_local(m, x, y, cfg, np.random.default_rng(1), DEV)
        for h in hooks:
            h.remove()
        assert stats["diverged"] == 0.0 and np.isfinite(stats["loss"])
        assert all(p.dtype == torch.float32 for p in m.parameters())  # master weights stay float32
        dtypes[amp], models[amp] = seen, m
    assert autocast_for(DEV, True)[0] and not autocast_for(DEV, False)[0]
    assert dtypes[False] == {torch.float32}
    assert torch.float16 in dtypes[True]  # the forward pass ran under autocast
    acc = {amp: evaluate(m, digits.test.x, digits.test.y, device=DEV)["accuracy"] for amp, m in models.items()}
    assert acc[False] > 0.5 and abs(acc[True] - acc[False]) < 0.05, acc


# -- evaluation -----------------------------------------------------------------------------

def test_evaluation_on_cuda_equals_cpu(digits):
    x, y = digits.test.x, digits.test.y
    models = [_model(CONV, seed=s) for s in range(4)]
    for m in models:
        train_local(m, digits.pool.x[:128], digits.pool.y[:128], TrainConfig(epochs=1), np.random.default_rng(0))
    want = [evaluate(m, x, y, batch_size=100) for m in models]
    on_dev = [copy.deepcopy(m).to(DEV) for m in models]
    got = [evaluate(m, x, y, batch_size=100, device=DEV) for m in on_dev]
    grouped = evaluate_group(on_dev, [x] * 4, [y] * 4, batch_size=100)
    for w, g, gg in zip(want, got, grouped):
        for r in (g, gg):
            assert abs(r["accuracy"] - w["accuracy"]) <= 2 / len(x)  # a near-tie may flip
            assert abs(r["loss"] - w["loss"]) <= RTOL * w["loss"]


# -- the batched step against the per-node loop ---------------------------------------------

def test_batched_step_on_cuda_equals_the_per_node_loop_on_cuda(digits):
    sizes = [40, 40, 33, 40, 25, 40]  # unequal splits: the masked, padded batches too
    offs = np.cumsum([0, *sizes])
    data = [(digits.pool.x[o:o + n], digits.pool.y[o:o + n]) for o, n in zip(offs, sizes)]
    loop = [_model(CONV, seed=i).to(DEV) for i in range(len(sizes))]
    batched = [copy.deepcopy(m) for m in loop]
    # the same step count for every member (what BatchTrainer groups): steps, not epochs
    cfg = TrainConfig(steps=5, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4)
    want = [train_local(m, x, y, cfg, np.random.default_rng(i), DEV) for i, (m, (x, y)) in enumerate(zip(loop, data))]
    members = [(m, x, y, round_batches(len(x), cfg, np.random.default_rng(i)))
               for i, (m, (x, y)) in enumerate(zip(batched, data))]
    got = train_group(members, cfg)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a["loss"] - b["loss"]) <= RTOL * abs(b["loss"]), i
        assert next(batched[i].parameters()).device == next(loop[i].parameters()).device
        _assert_params_close(batched[i], loop[i])


# -- checkpoints across devices ---------------------------------------------------------------

def _federation(name, bundle, spec, device, rounds=2):
    cls = get_algorithm(name)
    opts = parse_options(cls, {"round_timeout": 5.0} if "round_timeout" in cls.Options.__dataclass_fields__ else {})
    net = MemoryNetwork()
    train = TrainConfig(epochs=1, batch_size=32, lr=0.05, momentum=0.9)
    nodes = []
    for i in range(2):
        nid = f"n{i}"
        ctx = RuntimeContext(node_id=nid, federation="f", transport=net.transport(nid, "f", {}),
                             peers=PeerTable(nid, "f"), data=node_data_for(bundle, 8, i, "iid", seed=0),
                             model_spec=spec, train=train, init_seed=7, rng=np.random.default_rng([0, i]),
                             seed=0, device=device)
        nodes.append(Node(ctx, cls(ctx, opts), bundle.test.x[:50], bundle.test.y[:50], rounds=rounds))
    return nodes


def _module_devices(algorithm) -> set[str]:
    return {p.device.type for v in vars(algorithm).values() if isinstance(v, torch.nn.Module) for p in v.parameters()}


@pytest.mark.parametrize("name", ["fedavg", "fedd2s"])
def test_checkpoint_cuda_to_cpu_to_cuda(tmp_path, digits, name):
    spec = CONV if name == "fedd2s" else default_spec((1, 8, 8), 10, "small")
    trained = _federation(name, digits, spec, DEV)

    async def main():
        for nd in trained:
            await nd.ctx.start()
        for nd in trained:
            await nd.setup()
        await asyncio.gather(*(nd.run(2) for nd in trained))
        for nd in trained:
            await nd.ctx.stop()

    run_virtual(main())
    src = trained[0]
    assert _module_devices(src.algorithm) == {torch.device(DEV).type}
    want_t, want_m = src.algorithm.state_dict()
    NodeCheckpointer(CheckpointStore(tmp_path / "gpu"), src.algorithm, src.ctx, spec_hash(spec)).save(2)

    hops = []
    for device, folder, save_to in (("cpu", "gpu", "cpu"), (DEV, "cpu", None)):
        node = _federation(name, digits, spec, device)[0]
        run_virtual(node.setup())
        ck = NodeCheckpointer(CheckpointStore(tmp_path / folder), node.algorithm, node.ctx, spec_hash(spec))
        assert ck.restore() == 2
        got_t, got_m = node.algorithm.state_dict()
        assert sorted(got_t) == sorted(want_t)
        for k, v in want_t.items():
            assert got_t[k].dtype == v.dtype and np.array_equal(got_t[k], v), (device, k)
        assert _module_devices(node.algorithm) == {torch.device(device).type}
        if save_to:
            NodeCheckpointer(CheckpointStore(tmp_path / save_to), node.algorithm, node.ctx, spec_hash(spec)).save(2)
        hops.append(node)
    # the restored CUDA node trains on
    m = hops[-1].algorithm.deployable_model()
    d = hops[-1].ctx.data
    assert train_local(m, d.train_x, d.train_y, TrainConfig(), np.random.default_rng(0), DEV)["diverged"] == 0.0


def test_optimizer_state_moves_across_devices():
    """An optimizer's momentum buffers saved on the GPU come back on the device of the
    parameters they belong to (cpu, then the GPU again), and the next step runs."""
    from dfl_agent.algorithms.base import Algorithm

    class WithOptimizer(Algorithm):
        name = "test-optimizer-state"

        def __init__(self, device):
            self.model = _model(CONV).to(device)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

        def step(self, device):
            self.opt.zero_grad()
            self.model(torch.ones(4, 1, 8, 8, device=device)).sum().backward()
            self.opt.step()

    a = WithOptimizer(DEV)
    a.step(DEV)
    tensors, meta = a.state_dict()
    for device in ("cpu", DEV):
        b = WithOptimizer(device)
        b.load_state_dict(tensors, meta)
        bufs = [st["momentum_buffer"] for st in b.opt.state.values()]
        assert bufs and all(buf.device.type == torch.device(device).type for buf in bufs)
        b.step(device)
        tensors, meta = b.state_dict() if device == "cpu" else (tensors, meta)


# -- ONNX -------------------------------------------------------------------------------------

def test_onnx_export_of_a_model_trained_on_cuda(digits, tmp_path):
    pytest.importorskip("onnxscript", reason="the onnx extra is not installed")
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    from dfl_agent.models.onnx_export import export_checked
    from dfl_agent.onnx_model import OnnxModel

    m = _model(CONV).to(DEV)
    train_local(m, digits.pool.x[:256], digits.pool.y[:256], TrainConfig(epochs=2), np.random.default_rng(0), DEV)
    x = digits.test.x[:64]
    data = export_checked(m, (1, 8, 8), x, spec=CONV, path=tmp_path / "model.onnx")
    assert next(m.parameters()).device.type == torch.device(DEV).type  # the export copied it to cpu
    got = OnnxModel(data).predict_logits(x)
    with torch.no_grad():
        want = m.eval()(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(DEV)).cpu().numpy()
    assert np.abs(got - want).max() <= 1e-4
    assert (tmp_path / "model.onnx").read_bytes() == data


# -- the simulator ----------------------------------------------------------------------------

def test_simulator_on_cuda_agrees_with_cpu():
    from dfl_agent.runtime.node.simulator import SimConfig, simulate

    base = dict(algorithm="fedavg", dataset="digits", partition="iid", nodes=8, rounds=3, seed=0,
                train=TrainConfig(epochs=3, batch_size=16), topology="ring")
    cpu = simulate(SimConfig(**base))
    dev = simulate(SimConfig(**base, device=DEV))
    assert dev["config"]["device"] == DEV
    assert dev["batching"]["batched_nodes"] > 0  # the vectorised step ran on the device
    for a, b in zip(cpu["curve"]["global_accuracy"], dev["curve"]["global_accuracy"]):
        assert abs(a - b) <= 0.01, (cpu["curve"], dev["curve"])
    assert cpu["global_accuracy"]["mean"] > 0.5
    if DEV != "cpu":
        assert dev["cuda_peak_memory_mb"] > 0 and dev["cuda_device_name"] == torch.cuda.get_device_name(0)
