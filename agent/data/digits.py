"""digits and iris: data sets bundled with scikit-learn (the ``digits`` extra).

``sklearn.datasets.load_digits()`` / ``load_iris()`` ship with scikit-learn; nothing is
downloaded.  ``groups`` = -1 (no writer ids).  The global test set is a fixed
stratified split drawn with seed 0 (independent of the run's seed, so every run and
every node sees the same test set); the pool is the rest.

digits
    1797 images, 10 classes.  ``x`` = pixel intensity / 16, float32 ``(N, 1, 8, 8)``
    in [0, 1].  Test set: 20 %.

iris
    150 samples, 4 features (sepal/petal length and width in cm, unscaled, as in the
    MoDeFL thesis's Iris experiments, seed 003 §5.4.1), 3 classes.  ``x`` float32
    ``(N, 4)``.  Test set: 10 % (the thesis's 90 % : 10 % train/test).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from dfl_agent.data.dataset import Dataset, DatasetBundle, split_indices, stream_rng

TEST_FRACTION = 0.2
IRIS_TEST_FRACTION = 0.1
SPLIT_SEED = 0


def load_digits() -> DatasetBundle:
    """Load the digits pool/test bundle.

    Raises:
        ImportError: scikit-learn is missing (the message says how to install it).
    """
    raw = _sklearn_load("digits")
    images = np.asarray(raw.images, dtype=np.float64)           # (N, 8, 8), 0..16
    x = np.ascontiguousarray((images / 16.0)[:, None, :, :], dtype=np.float32)
    return _bundle("digits", x, raw.target, [str(i) for i in range(10)], TEST_FRACTION)


def load_iris() -> DatasetBundle:
    """Load the Iris pool/test bundle.

    Raises:
        ImportError: scikit-learn is missing (the message says how to install it).
    """
    raw = _sklearn_load("iris")
    x = np.ascontiguousarray(raw.data, dtype=np.float32)
    return _bundle("iris", x, raw.target, [str(c) for c in raw.target_names], IRIS_TEST_FRACTION)


def _sklearn_load(name: str) -> Any:
    try:
        datasets = importlib.import_module("sklearn.datasets")
    except ImportError as e:
        from dfl_agent.extras import extra_hint

        raise ImportError(f"the {name} data set needs scikit-learn; install it with {extra_hint('digits')}") from e
    return getattr(datasets, f"load_{name}")()


def _bundle(name: str, x: np.ndarray, target: Any, class_names: list[str], test_fraction: float) -> DatasetBundle:
    y = np.asarray(target, dtype=np.int64)
    full = Dataset(name=name, x=x, y=y, groups=np.full(y.shape, -1, np.int64),
                   num_classes=len(class_names), class_names=class_names, input_shape=x.shape[1:])
    pool_idx, test_idx = split_indices(y, test_fraction, stream_rng(SPLIT_SEED, f"{name}/test"))
    return DatasetBundle(pool=full.subset(np.sort(pool_idx)), test=full.subset(np.sort(test_idx)))
