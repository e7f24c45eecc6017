"""The driver-binding layer: the only package that imports cuda-python.

``driver`` (checked driver calls, capabilities, contexts, streams, events, the CUDA host pinner),
``copier`` (copy descriptors to the driver), ``kernel`` (the NVRTC copy kernel) and ``pinning``
(chunked registration behind a protocol; imports no CUDA, so the host backend runs without
cuda-python installed).
"""
