"""The disk tier below the host pool: ``config`` (what to open and what it reports), ``format`` (the
file and record format, opening a file), ``index`` (which records a read may return), ``requests``
and ``stages`` (a request's pieces and the threads that move them), ``tier`` (the DiskTier), and
``pipeline`` (device <-> disk jobs through pinned bounce slots)."""
