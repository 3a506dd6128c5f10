"""The inference-only member: serves predictions with the federation's model, without torch.

- :mod:`dfl_agent.onnx_model`: :class:`~dfl_agent.onnx_model.OnnxModel` (onnxruntime);
  :mod:`dfl_agent.inference.windows`: window loading
  (``.npz`` with ``x`` as in ``agent/data/FORMAT.md``, or CSV of flattened windows).
- :mod:`dfl_agent.inference.member`: :class:`InferenceMember`: joins a federation over
  MQTT, receives the current model as ONNX (message kind ``onnx.model``) from a
  training peer, predicts on its own windows, publishes presence and status.
- the training side: a run exports its deployable model when it improves
  (:mod:`dfl_agent.runtime.run.live_export`, imports torch lazily) or deploys it, and the node's
  service sends it to the inference members (:mod:`dfl_agent.runtime.service.member_delivery`).
- ``dfl-infer`` (:mod:`dfl_agent.cli.infer`): ``run`` (the member) and ``predict``.

Nothing in this package imports torch (the export, in the runtime, imports it inside its
functions, which only training nodes call).  Install on a torch-less device:
``pip install 'dfl_agent-VERSION-py3-none-any.whl[inference]'`` (the wheel; see
``docs/how-to/inference-only.md``), which adds onnxruntime to the torch-free base install.
"""
