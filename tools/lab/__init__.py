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
- :mod:`.tls`: the lab's CA and broker certificates.

Nothing here imports torch (the report's accuracy uses onnxruntime).
"""
