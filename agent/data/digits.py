"""digits: scikit-learn's bundled 8x8 handwritten digits (the ``digits`` extra).

``sklearn.datasets.load_digits()`` ships with scikit-learn; nothing is
downloaded.  1797 images, 10 classes.  ``x`` = pixel intensity / 16, float32
``(N, 1, 8, 8)`` in [0, 1]; ``groups`` = -1 (no writer ids).  The global test
set is a fixed stratified 20 % split drawn with seed 0 (independent of the
run's seed, so every run and every node sees the same test set); the pool is
the other 80 %.
"""

from __future__ import annotations

import numpy as np

from dfl_agent.data.dataset import Dataset, DatasetBundle, split_indices, stream_rng

__all__ = ["load_digits", "TEST_FRACTION", "SPLIT_SEED"]

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def load_digits() -> DatasetBundle:
    """Load the digits pool/test bundle.

    Raises:
        ImportError: scikit-learn is missing (the message says how to install it).
    """
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as e:
        from dfl_agent.extras import extra_hint

        raise ImportError(f"the digits data set needs scikit-learn; install it with {extra_hint('digits')}") from e
    raw = _sk_load_digits()
    images = np.asarray(raw.images, dtype=np.float64)           # (N, 8, 8), 0..16
    x = np.ascontiguousarray((images / 16.0)[:, None, :, :], dtype=np.float32)
    y = np.asarray(raw.target, dtype=np.int64)
    full = Dataset(name="digits", x=x, y=y, groups=np.full(y.shape, -1, np.int64),
                   num_classes=10, class_names=[str(i) for i in range(10)],
                   input_shape=(1, 8, 8))
    pool_idx, test_idx = split_indices(y, TEST_FRACTION, stream_rng(SPLIT_SEED, "digits/test"))
    return DatasetBundle(pool=full.subset(np.sort(pool_idx)), test=full.subset(np.sort(test_idx)))
