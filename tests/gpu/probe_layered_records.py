"""What a layered load costs from host records that do not follow each other, per path:
``python -m tests.gpu.probe_layered_records [--paths auto,staged,sm] [--pages 4,32] [--records ...]
[--strided 64:1024,64:0]`` (needs a GPU).

Not a test (nothing is asserted; pytest does not collect it): the measurement behind ``auto``'s
choice of a layered load's path (docs/design.md §12, *The path of a layered load*). A 16-layer
per-layer layout (K and V pages per layer: a layer's span of a record is two pages), 256 blocks
loaded with ``load_by_layer`` from host records

* ``in order`` (one run: the native issuer moves a staged layer as one strided copy),
* ``runs of R`` (R records that follow each other, then one left out),
* ``gapped`` (every other record: a descriptor per record and layer),
* ``shuffled`` (256 records of 512 picked at random),

each against one pinned copy of the same bytes timed call -> synchronized in the same round: the
whole layered load on the device (an event before the call to one after ``wait_layer(L-1)``), when
layer 0 was ready, the same job as a plain ``load`` alone (call -> result), and the path each took.
Every loaded byte is checked. ``--strided`` compares the native issuer's thresholds for strided
copies (``MIN_ROWS:ROW_BYTES``: ``STRIDED_MIN_ROWS``, ``STRIDED_ROW_BYTES``; ``4:0`` moves runs of
4 records and more as strided copies at any width, ``1000000:0`` none).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import numpy.typing as npt
import torch

from kvoffload import Worker
from kvoffload.backends import native as native_backend
from kvoffload.cli._torch import new_event, new_stream
from kvoffload.cli.latency_bench import PinnedCopy, _job, _per_layer, host_records

LAYERS = 16
BLOCKS = 256
ROUNDS = 7
I64 = npt.NDArray[np.int64]


def records(kind: str, rng: np.random.Generator) -> I64:
    """The host records of one load (see the module docstring)."""
    if kind in ("in order", "gapped"):
        return host_records(kind, BLOCKS)
    i = np.arange(BLOCKS, dtype=np.int64)
    if kind == "shuffled":
        return rng.permutation(2 * BLOCKS)[:BLOCKS].astype(np.int64)
    run = int(kind.rsplit(maxsplit=1)[-1])  # "runs of R"
    return (i // run) * (run + 1) + i % run


def measure(w: Worker, tensors: dict[str, torch.Tensor], copy: PinnedCopy, host: I64, job: int,
            stream: torch.cuda.Stream) -> tuple[str, int]:
    """One line of figures for ``w``'s layered loads from ``host``; returns it and the next job id."""
    device = copy.dev.device
    src = np.arange(BLOCKS, dtype=np.int64)
    dst = src + BLOCKS
    w.store(job, src, host)
    (stored,) = w.wait([job], 60.0)
    assert stored.ok, stored.error
    job += 1
    full, first, plain, copies = [], [], [], []
    paths: set[str] = set()
    whole: set[str] = set()
    for t in tensors.values():
        t[:, BLOCKS:].zero_()
    for rnd in range(ROUNDS + 2):  # two warm-ups
        torch.cuda.synchronize(device)
        total, _, result = _job(w, False, job, dst, host)
        whole.add(result.path)
        job += 1
        begin, ready0, end = (new_event(timing=True) for _ in range(3))
        torch.cuda.synchronize(device)
        begin.record(stream)
        load = w.load_by_layer(job, host, dst, stream=stream)
        load.wait_layer(0, stream)
        ready0.record(stream)
        load.wait_layer(LAYERS - 1, stream)
        end.record(stream)
        (layered,) = w.wait([job], 60.0)
        assert layered.ok, layered.error
        paths.add(layered.path)
        job += 1
        end.synchronize()
        c = copy.seconds(False)
        if rnd >= 2:
            plain.append(total * 1e6)
            copies.append(c * 1e6)
            first.append(float(begin.elapsed_time(ready0)) * 1e3)
            full.append(float(begin.elapsed_time(end)) * 1e3)
    ok = all(torch.equal(t[:, BLOCKS:], t[:, :BLOCKS]) for t in tensors.values())
    c, f, p = statistics.median(copies), statistics.median(full), statistics.median(plain)
    line = (f"copy {c:8.1f} us | layered {f:8.1f} us ({c / f:4.2f}x, {','.join(sorted(paths))}) layer 0 "
            f"{statistics.median(first):7.1f} (1/L {f / LAYERS:6.1f}) | plain load {p:8.1f} ({c / p:4.2f}x, "
            f"{','.join(sorted(whole))}) | {'bit-exact' if ok else 'MISMATCH'}")
    return line, job


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", default="auto,staged,sm")
    parser.add_argument("--issuers", default="native")
    parser.add_argument("--pages", default="4,32", help="page sizes in KiB")
    parser.add_argument("--records", default="in order,runs of 16,runs of 4,runs of 2,gapped,shuffled")
    parser.add_argument("--strided", default="",
                        help="the native issuer's strided-copy thresholds to compare, MIN_ROWS:ROW_BYTES "
                             "pairs, comma-separated (STRIDED_MIN_ROWS, STRIDED_ROW_BYTES; default: the "
                             "library's)")
    args = parser.parse_args(argv)
    library = (native_backend.STRIDED_MIN_ROWS, native_backend.STRIDED_ROW_BYTES)
    thresholds = [tuple(int(v) for v in pair.split(":")) for pair in args.strided.split(",") if pair] or [library]
    device = torch.device("cuda", 0)
    stream = new_stream(device)
    rng = np.random.default_rng(11)
    bad = 0
    print(f"probe_layered_records on {torch.cuda.get_device_name(device)}: {LAYERS} layers, {BLOCKS} "
          "blocks, K and V pages a layer", flush=True)
    for page in (int(p) << 10 for p in args.pages.split(",")):
        layout, tensors = _per_layer(device, LAYERS, page, 2 * BLOCKS)
        copy = PinnedCopy(device, BLOCKS * LAYERS * 2 * page)
        for issuer in args.issuers.split(","):
            for path in args.paths.split(","):
                for min_rows, row_bytes in thresholds if issuer == "native" else thresholds[:1]:
                    try:  # read when the worker's issuer is made
                        native_backend.STRIDED_MIN_ROWS, native_backend.STRIDED_ROW_BYTES = min_rows, row_bytes  # type: ignore[misc]
                        w = Worker.create(layout, 2 * BLOCKS, path=path, issuer=issuer)
                    finally:
                        native_backend.STRIDED_MIN_ROWS, native_backend.STRIDED_ROW_BYTES = library  # type: ignore[misc]
                    strided = f"{min_rows}:{row_bytes}" if issuer == "native" else "-"
                    with w:
                        job = 1
                        for kind in args.records.split(","):
                            line, job = measure(w, tensors, copy, records(kind, rng), job, stream)
                            bad += "MISMATCH" in line
                            print(f"span {2 * page >> 10:4d} KiB {issuer:<6} {path:<6} {strided:<7} {kind:<11} "
                                  f"{line}", flush=True)
        del tensors, copy
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
