"""The coordination families the algorithms are built on (not algorithms themselves: the
registry's package scan skips this package).

- :mod:`~dfl_agent.algorithms.protocols.rotating`: a rotating aggregator (token holder)
  per round (DFML, DFedAvg/DFedProx, HeteroFL/FedRolex, FedD2S, FedPer);
- :mod:`~dfl_agent.algorithms.protocols.neighbourhood`: neighbourhood gossip on a graph
  (FedAvg, DecHW, DecHetero, CFA);
- :mod:`~dfl_agent.algorithms.protocols.pairs`: sender → receiver pairs (Def-KT, FullAvg,
  Combo);
- :mod:`~dfl_agent.algorithms.protocols.lockstep`: every node steps together on one
  shared state (GT, local steps);
- :mod:`~dfl_agent.algorithms.protocols.synchronization`: when a round proceeds and
  which updates it takes (the update market, partial participation).
"""
