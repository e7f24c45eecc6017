"""The command-line tools behind ``python -m kvoffload`` (the command table is in ``__main__``).

``demo``, ``bench`` (with ``disk_bench``, ``latency_bench``, ``ranks_bench`` and ``remote_bench``),
``replay`` and ``manager_bench``: each module's ``main(argv)`` runs one command (the command table is
in ``kvoffload.__main__``). The tools use the public API only (``kvoffload`` and
``kvoffload.testing``), like an integrator's code would.
"""
