"""Integrations of kvoffload into inference engines that the project does not write.

Each integration is an optional extra (``pip install 'kvoffload[<engine>]'``); the core never imports
them, and they use only kvoffload's public surface (``kvoffload.__all__``).

- :mod:`kvoffload.integrations.transformers`: kvoffload as the host (and disk) tier of Hugging Face
  transformers' continuous batching (``model.generate_batch``), extra ``transformers``.
"""
