"""Differential privacy on the device: configuration, accounting and the run's plan.

* :mod:`dfl_agent.privacy.config`: the ``[privacy]`` section of the node configuration and the
  device profile (``privacy.dp`` and ``privacy.lifetime_epsilon``), validated with one-line errors;
* :mod:`dfl_agent.privacy.accountant`: the Rényi-DP accountant of the sampled Gaussian mechanism,
  in numpy and scipy (no torch: admission runs in the torch-free supervisor; scipy is imported
  only when a DP history is accounted);
* :mod:`dfl_agent.privacy.plan`: a run's DP plan (noise multiplier, sampling rate, steps, ε).

Importing this package imports nothing heavy.
"""
