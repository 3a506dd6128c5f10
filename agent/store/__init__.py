"""The on-device sample store: labelled samples that the device's application adds
while the agent runs (spool directory or ``dflctl data add``), kept in SQLite (WAL).

Torch-free: numpy and the standard library only.  See :mod:`dfl_agent.store.sqlite`.
"""

from dfl_agent.store.sqlite import (
    RejectedFile,
    SampleStore,
    Schema,
    StoreError,
    validation_mask,
)

__all__ = ["RejectedFile", "SampleStore", "Schema", "StoreError", "validation_mask"]
