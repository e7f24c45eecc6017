"""How fast the staged path's gather kernel moves pages, and what it costs a GEMM beside it.

``python -m tests.gpu.probe_gather [rounds]`` (needs CUDA). Kernel variants, alternated round by
round in one process so that the host's and the device's drift falls on each alike:

* ``now``: the library's copy kernel as it is;
* ``u8``: eight 16-byte loads in flight per lane instead of four;
* ``t1024``: 1024 threads a CTA instead of 512;
* ``u8t1024``: both.

Part 1, the kernel alone: the device time of one launch gathering 64 MiB of a bench layout's
blocks (random device blocks into a device staging buffer, as the staged store's gather does), at
4 KiB and 32 KiB pages, with one CTA per SM and with two; median of 20 launches, in GB/s of pages
moved. Part 2, beside a GEMM: ``bench.measure_path`` of the staged path (its store beside a GEMM
window, medians of its rounds) with each variant patched in, and the link's own cost (plain pinned
copies beside the GEMM) each round as the floor.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch

import kvoffload.backends.native as native_backend
import kvoffload.bindings.kernel as kmod
from kvoffload._descriptors import kernel_segments
from kvoffload.bindings.driver import device_attribute, make_context_current
from kvoffload.cli import bench
from kvoffload.cli._torch import new_event, new_stream
from cuda.bindings import driver as _drv

BASE_SOURCE = kmod.COPY_KERNEL_SOURCE
BASE_THREADS = kmod.COPY_KERNEL_THREADS
U8_LOOP = """        for (; i + 224 < n16; i += 256) {
            const uint4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
            const uint4 f = s[i + 128], g = s[i + 160], h = s[i + 192], k = s[i + 224];
            d[i] = a; d[i + 32] = b; d[i + 64] = c; d[i + 96] = e;
            d[i + 128] = f; d[i + 160] = g; d[i + 192] = h; d[i + 224] = k;
        }
"""
U4_MARK = "        for (; i + 96 < n16; i += 128) {"


def variant_source(unroll8: bool) -> str:
    if not unroll8:
        return BASE_SOURCE
    assert U4_MARK in BASE_SOURCE
    return BASE_SOURCE.replace(U4_MARK, U8_LOOP + U4_MARK)


VARIANTS = {"now": (False, 512), "u8": (True, 512), "t1024": (False, 1024), "u8t1024": (True, 1024)}


def use(name: str) -> None:
    unroll8, threads = VARIANTS[name]
    setattr(kmod, "COPY_KERNEL_SOURCE", variant_source(unroll8))
    setattr(kmod, "COPY_KERNEL_THREADS", threads)
    setattr(native_backend, "COPY_KERNEL_THREADS", threads)  # the native issuer's copy of it
    kmod.CopyKernel.for_device.cache_clear()


def kernel_alone(device: torch.device, page: int, ctas: int) -> float:
    """GB/s of one launch gathering 64 MiB (median of 20)."""
    layout = bench._layout(device, page, 64)
    segments = torch.from_numpy(kernel_segments(layout.page_table)).to(device)
    record = layout.block_bytes
    rows = bench.JOB_BYTES // record
    dev_ids = np.random.default_rng(page).permutation(64)[:rows].astype(np.int64)
    host_rows = np.arange(rows, dtype=np.int64)
    staging = torch.empty(rows * record, dtype=torch.uint8, device=device)
    stream = new_stream(device)
    launcher = kmod.CopyKernel.for_device(device.index or 0).launcher()
    times = []
    for _ in range(23):
        begin, end = new_event(timing=True), new_event(timing=True)
        begin.record(stream)
        launcher.launch(segments.data_ptr(), segments.shape[0], dev_ids, host_rows,
                        staging.data_ptr(), record, True, ctas, stream.cuda_stream)
        end.record(stream)
        end.synchronize()
        times.append(float(begin.elapsed_time(end)) / 1e3)
    ok = torch.equal(staging.view(rows, record), layout.gather_records(torch.from_numpy(dev_ids)))
    assert ok, "gather wrong"
    return float(rows * record / statistics.median(times[3:]) / 1e9)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    device = torch.device("cuda", 0)
    make_context_current(0)
    sms = device_attribute(0, _drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    print(f"{torch.cuda.get_device_name(device)}: {sms} SMs", flush=True)
    for r in range(rounds):
        for name in VARIANTS:
            use(name)
            cells = []
            for page in (4096, 32768):
                for ctas in (sms, 2 * sms):
                    cells.append(f"{page // 1024:>2} KiB {ctas:>3} CTAs {kernel_alone(device, page, ctas):7.0f}")
            print(f"round {r} alone {name:<8} " + " | ".join(cells), flush=True)
    gemm = bench.GemmLoad(device)
    for r in range(rounds):
        floor = bench.gemm_beside_link(gemm, device)
        line = [f"link {floor.describe()}"]
        for name in VARIANTS:
            use(name)
            for page in (4096, 32768):
                row = bench.measure_path(device, page, "staged", 512 << 20, gemm, sys.stderr)
                assert row.mismatched_blocks == 0
                assert row.gemm_slowdown is not None and row.gemm_store_gbps is not None
                line.append(f"{name} {page // 1024}K {100 * row.gemm_slowdown:.1f}% "
                            f"{row.gemm_store_gbps:.1f}GB/s st {row.store_gbps:.1f}")
        print(f"round {r} gemm " + " | ".join(line), flush=True)
    use("now")


if __name__ == "__main__":
    main()
