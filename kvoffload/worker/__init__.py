"""The worker layer: ``worker`` (the Worker: job routing, bookkeeping across directions, the
shutdown contract), ``assembly`` (builds what a worker is made of) and ``booking`` (which blocks the
jobs in flight read and write)."""
