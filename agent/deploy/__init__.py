"""Model delivery to the device's application: versioned folders under ``state_dir/models``
with an atomically switched ``current`` link (contract: ``FORMAT.md`` in this package).

:mod:`dfl_agent.deploy.versions` is torch-free (``dflctl model show|rollback|deploy``);
:mod:`dfl_agent.deploy.gate` exports and gates the agent's model (needs torch).
Pure files, no network: the runtime announces a deployment.
"""

from dfl_agent.deploy.versions import DeployError, ModelStore, verify_folder

__all__ = ["DeployError", "ModelStore", "verify_folder"]
