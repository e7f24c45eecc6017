"""Adapters that plug kvoffload into inference engines.

Each adapter is an optional extra: the core package never imports this package, and an adapter
imports only kvoffload's public surface (``kvoffload`` and ``kvoffload.testing``).

- :mod:`kvoffload.integrations.vllm`: vLLM's ``OffloadingConnector`` loads kvoffload as its
  offloading spec (``pip install 'kvoffload[vllm]'``); :mod:`kvoffload.integrations.vllm_support`
  holds the parts that do not need vLLM installed (version pin, options, record mapping, errors).
"""
