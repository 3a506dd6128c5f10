"""The data layer: data sets, partitions among nodes, and each node's local split.

Numpy only (no torch); nothing is downloaded at run time.  See
:mod:`dfl_agent.data.loading` for the typical call sequence, ``FORMAT.md`` for the
directory format of a device's own data, and each loader module (``har``,
``digits``, ``idx``, ``npzdir``) for its source, preprocessing and split.
All randomness derives from an explicit integer seed.
"""

from dfl_agent.data.dataset import Dataset, DatasetBundle, NodeData
from dfl_agent.data.loading import DATASETS, load_dataset, make_node_data, node_data_for
from dfl_agent.data.partition import PARTITIONS, partition

__all__ = [
    "Dataset",
    "DatasetBundle",
    "NodeData",
    "load_dataset",
    "partition",
    "make_node_data",
    "node_data_for",
    "DATASETS",
    "PARTITIONS",
]
