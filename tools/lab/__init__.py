"""The field lab (``dflctl lab``): an emulated site network on one Linux host, as root.

- :mod:`.check`: which of the host's capabilities the lab can use (``dflctl lab check``);
- :mod:`.net`: :class:`~.net.LabNet`, the topology (a namespace per host, a bridge per
  site, a router between sites, shaped links, a cgroup per host, processes inside them);
- :mod:`.cgroups`: a host's CPU and memory cgroup (v1 or v2);
- :mod:`.state`: the state file listing every object a lab made, and the teardown that
  removes exactly those (``dflctl lab down``);
- :mod:`.scenario`: scenario files (parsed and checked; a bad key is named);
- :mod:`.runner`: ``dflctl lab run`` (brokers, operator, agents, feeder, the timeline);
- :mod:`.report`: ``report.json``, ``report.md``, the plots and the scenario's checks;
- :mod:`.accuracy`: every round model's held-out accuracy (from the run's checkpoints) and
  the time a run takes to reach a target;
- :mod:`.traffic`: the bytes on every link, sampled from the switches' counters;
- :mod:`.tls`: the lab's CA and broker certificates.

Nothing here imports torch at import time: the report's accuracy uses onnxruntime, and
torch (which the agents train with) only where a model must be rebuilt.
"""
