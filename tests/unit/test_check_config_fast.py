"""``dfl-agent check-config`` without torch: the data from its headers, the model from its spec."""

import subprocess
import sys

import numpy as np
import pytest

# check-config in a process where torch cannot be imported at all: it must pass, and
# nothing may even have tried to import torch (a blocked entry stays None in sys.modules)
_NO_TORCH = """
import sys
sys.modules["torch"] = None
from dfl_agent.runtime.service.daemon import main
code = main(["check-config", "--config", sys.argv[1]])
assert sys.modules.get("torch", "absent") is None, "torch was imported"
assert not [m for m in sys.modules if m.startswith("torch.")], "a torch submodule was imported"
sys.exit(code)
"""


def _har_config(tmp_path, cache, extra=""):
    path = tmp_path / "node.toml"
    path.write_text(f'federation = "f"\nnode_id = "n0"\nstate_dir = "{tmp_path / "state"}"\n{extra}'
                    f'[data]\ndataset = "har"\ncache_dir = "{cache}"\n[mqtt]\nbroker = "127.0.0.1:1"\n')
    return path


@pytest.fixture(scope="module")
def har_cache(tmp_path_factory):
    from dfl_agent.data import load_dataset

    cache = tmp_path_factory.mktemp("har-cache")
    load_dataset("har", cache_dir=cache)  # converts once into this cache
    return cache


@pytest.mark.parametrize("extra", ["", '[algorithm]\nname = "dfml"\n', '[model]\nsize = "large"\n'])
def test_check_config_on_har_imports_no_torch(tmp_path, har_cache, extra):
    path = _har_config(tmp_path, har_cache, extra)
    p = subprocess.run([sys.executable, "-c", _NO_TORCH, str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "configuration OK"
    assert not (tmp_path / "state").exists()


def test_check_config_still_finds_a_model_error_without_torch(tmp_path, har_cache):
    """A model that does not fit the data is found from the spec and the headers."""
    spec = '[model]\nspec = {type = "cnn1d", in_channels = 3, length = 128, channels = [8], num_classes = 5}\n'
    path = _har_config(tmp_path, har_cache, spec)
    p = subprocess.run([sys.executable, "-c", _NO_TORCH, str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "model: model.spec has 5 classes, the data 6" in p.stderr, p.stderr


def test_inspect_har_describes_what_load_har_loads(har_cache):
    from dfl_agent.data.har import inspect_har, load_har

    bundle = load_har(har_cache)
    assert inspect_har(har_cache) == {"input_shape": bundle.pool.input_shape, "num_classes": bundle.pool.num_classes,
                                      "pool_size": len(bundle.pool), "test_size": len(bundle.test)}


def test_inspect_har_leaves_a_bad_cache_to_load_har(tmp_path, har_cache):
    """A missing or damaged cache gives None (load_har then converts or names the problem)."""
    from dfl_agent.data.cache import atomic_savez, read_npz
    from dfl_agent.data.har import CACHE_FILE, inspect_har

    assert inspect_har(tmp_path / "empty") is None
    arrays = read_npz(har_cache / CACHE_FILE)
    for key, bad in [("x_pool", arrays["x_pool"].astype(np.float64)), ("y_test", arrays["y_test"] + 6),
                     ("g_pool", arrays["g_test"]), ("format_version", np.asarray(0))]:
        atomic_savez(tmp_path / key / CACHE_FILE, {**arrays, key: bad})
        assert inspect_har(tmp_path / key) is None, key
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / CACHE_FILE).write_bytes(b"PK\x03\x04 not really")
    assert inspect_har(tmp_path / "junk") is None


def test_read_npy_headers_reads_shapes_and_dtypes_only(tmp_path):
    from dfl_agent.data.cache import read_npy_headers

    path = tmp_path / "a.npz"
    np.savez(path, x=np.zeros((7, 3, 4), np.float32), y=np.arange(7))
    assert read_npy_headers(path, ("x", "y")) == {"x": ((7, 3, 4), np.dtype(np.float32)),
                                                  "y": ((7,), np.dtype(np.int64))}
    with pytest.raises(ValueError, match="missing array 'z'"):
        read_npy_headers(path, ("z",))
    (tmp_path / "b.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable .npz file"):
        read_npy_headers(tmp_path / "b.npz", ("x",))


@pytest.mark.parametrize("spec", [
    {"type": "cnn1d", "in_channels": 3, "length": 128, "channels": [16, 32, 64], "kernel": 5, "num_classes": 6},
    {"type": "cnn1d", "in_channels": 3, "length": 100, "channels": [8, 12], "kernel": 3, "num_classes": 4,
     "norm": "layer"},
    {"type": "mlp", "input_shape": [1, 8, 8], "hidden": [128, 64], "num_classes": 10},
    {"type": "mlp", "input_shape": [4], "hidden": [], "num_classes": 3},
    {"type": "cnn", "in_channels": 1, "image_size": 28, "widths": [32, 64], "kernel": 5, "num_classes": 10},
    {"type": "cnn", "in_channels": 3, "image_size": 17, "widths": [4, 6, 8], "kernel": 3, "num_classes": 2},
])
def test_spec_param_count_equals_the_built_model(spec):
    pytest.importorskip("torch")
    from dfl_agent.models import build_model, count_trainable, spec_param_count

    assert spec_param_count(spec) == count_trainable(build_model(spec))


def test_spec_param_count_leaves_other_types_to_the_built_model():
    pytest.importorskip("torch")
    from dfl_agent.models import spec_param_count

    assert spec_param_count({"type": "resnet", "input_shape": [1, 8, 8], "widths": [8, 16], "blocks": [1, 1],
                             "num_classes": 10}) is None
