"""Adapters that plug kvoffload into inference engines the project does not write.

Each adapter is an optional extra (``pip install 'kvoffload[<engine>]'``): the core package never
imports this package, and an adapter imports only kvoffload's public surface (``kvoffload`` and
``kvoffload.testing``).

- :mod:`kvoffload.integrations.transformers`: kvoffload as the host (and disk) tier of Hugging Face
  transformers' continuous batching (``model.generate_batch``), extra ``transformers``;
  :mod:`kvoffload.integrations.transformers_demo` is ``python -m kvoffload engine-demo``.
- :mod:`kvoffload.integrations.vllm`: vLLM's ``OffloadingConnector`` loads kvoffload as its
  offloading spec, extra ``vllm``; :mod:`kvoffload.integrations.vllm_support` holds the parts that
  do not need vLLM installed (version pin, options, record mapping, errors).
"""
