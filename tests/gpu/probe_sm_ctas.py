"""The ``sm`` path's kernel at two CTA counts, side by side in one process:
``python -m tests.gpu.probe_sm_ctas [--ctas 8,4] [--rounds 2]`` (needs a GPU).

Not a test (nothing is asserted; pytest does not collect it): the measurement behind the ``sm``
path's default CTA count (``kvoffload.backends.kernel.SM_CTAS``, docs/design.md §16, *`sm` at 4
CTAs*). Fewer CTAs hold fewer SMs through a job, so a GEMM beside ``sm`` loses less; whether they
still fill the host link is the host's. Per round, the counts alternated in each part:

* isolated 64 MiB jobs through ``sm`` (native issuer) at 4 KiB pages, host records in order and
  from every other record, store and load, each next to a pinned copy of the same bytes (every
  count's worker open at once, the counts taking turns job by job, as ``bench --latency``'s table);
* 1-block jobs (64 x 32 KiB) through ``sm`` against a 2 MiB pinned copy (``bench --latency``'s row),
  ``SM_CTAS`` set before each worker is made;
* ``bench --layerwise``'s prefill at 4 KiB pages from every other record through ``sm`` (where
  ``auto`` takes ``sm`` for a layered load), ``SM_CTAS`` set before each case.

Every loaded byte is checked (the rows' last column, and the prefill's mismatched blocks).
"""

from __future__ import annotations

import argparse
import io
import sys

import torch

from kvoffload.backends import kernel as kernel_module
from kvoffload.cli._args import int_in, int_list
from kvoffload.cli.latency_bench import _prefill_case, isolated_jobs, one_block_jobs

KIB, MIB = 1 << 10, 1 << 20
PAGE = 4 * KIB
JOB_BYTES = 64 * MIB
REPEATS = 7
LAYERS = 16


def isolated(device: torch.device, counts: tuple[int, ...]) -> list[str]:
    """The isolated-job rows of every count (``bench --latency``'s table), records in order and
    gapped, the counts taking turns job by job."""
    records = ("in order", "gapped")
    rows = isolated_jobs(device, PAGE, JOB_BYTES, [("sm", "native")] * len(counts), REPEATS, io.StringIO(),
                         records, kernel_ctas=counts)
    per_count = len(rows) // len(counts)
    return [f"{counts[i // per_count]:>2} CTAs {row}" for i, row in enumerate(rows)]


def main(argv: list[str]) -> int:
    """Measure and print (see the module docstring); 1 when a prefill's loaded byte differed."""
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.probe_sm_ctas")
    parser.add_argument("--ctas", type=int_list(1, 1024), default=(8, 4),
                        help="comma-separated CTA counts (default 8,4)")
    parser.add_argument("--rounds", type=int_in(1), default=2, help="rounds (default 2)")
    args = parser.parse_args(argv)
    counts: tuple[int, ...] = args.ctas
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    default = kernel_module.SM_CTAS
    print(f"probe_sm_ctas on {torch.cuda.get_device_name(device)}: counts {counts}, {args.rounds} rounds "
          f"(default SM_CTAS {default})", flush=True)
    print("isolated jobs: page, job, direction, records, path, call -> result us, copy us, copy/job, "
          "caller us, device us, mismatched blocks", flush=True)
    bad = 0
    try:
        for rnd in range(args.rounds):
            print(f"== round {rnd + 1}", flush=True)
            for row in isolated(device, counts):
                print("  " + row, flush=True)
            for n in counts:
                setattr(kernel_module, "SM_CTAS", n)  # read as each worker is made
                print(f"  {n:>2} CTAs {one_block_jobs(device, 'sm', REPEATS, 'native')}", flush=True)
            for n in counts:
                setattr(kernel_module, "SM_CTAS", n)
                lines, wrong = _prefill_case(device, ("sm",), ("native",), LAYERS, PAGE, "gapped", "in order",
                                             io.StringIO())
                bad += wrong
                for line in lines:
                    print(f"  {n:>2} CTAs {line}", flush=True)
    finally:
        setattr(kernel_module, "SM_CTAS", default)
    print(f"prefill mismatched blocks: {bad}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
