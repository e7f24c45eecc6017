"""Where a direction's copies run: the host backend (``host``), and the CUDA backend (``cuda``)
composed of transfer paths (batched DMA there; the copy-kernel paths ``sm`` and ``staged`` in
``kernel``). They fill the seam the handler defines (``kvoffload.handler.Backend``) structurally:
nothing here imports the handler."""
