"""iris: scikit-learn's bundled Iris flowers (the ``digits`` extra: scikit-learn).

``sklearn.datasets.load_iris()`` ships with scikit-learn; nothing is downloaded.
150 samples, 4 features (sepal/petal length and width in cm, unscaled, as in the
MoDeFL thesis's Iris experiments, seed 003 §5.4.1), 3 classes.  ``x`` float32
``(N, 4)``; ``groups`` = -1.  The global test set is a fixed stratified 10 % split
drawn with seed 0 (the thesis's 90 % : 10 % train/test); the pool is the other 90 %.
"""

from __future__ import annotations

import numpy as np

from dfl_agent.data.dataset import Dataset, DatasetBundle, split_indices, stream_rng

__all__ = ["load_iris", "TEST_FRACTION", "SPLIT_SEED"]

TEST_FRACTION = 0.1
SPLIT_SEED = 0


def load_iris() -> DatasetBundle:
    """Load the Iris pool/test bundle.

    Raises:
        ImportError: scikit-learn is missing (the message says how to install it).
    """
    try:
        from sklearn.datasets import load_iris as _sk_load_iris
    except ImportError as e:
        from dfl_agent.extras import extra_hint

        raise ImportError(f"the iris data set needs scikit-learn; install it with {extra_hint('digits')}") from e
    raw = _sk_load_iris()
    x = np.ascontiguousarray(raw.data, dtype=np.float32)
    y = np.asarray(raw.target, dtype=np.int64)
    full = Dataset(name="iris", x=x, y=y, groups=np.full(y.shape, -1, np.int64),
                   num_classes=3, class_names=[str(c) for c in raw.target_names],
                   input_shape=(4,))
    pool_idx, test_idx = split_indices(y, TEST_FRACTION, stream_rng(SPLIT_SEED, "iris/test"))
    return DatasetBundle(pool=full.subset(np.sort(pool_idx)), test=full.subset(np.sort(test_idx)))
