"""The native library (the issuer thread and the worker's admission check): ``issuer.c`` compiled with the machine's C compiler on first use,
cached, and loaded through ctypes (docs/design.md §16); and its call front, ``front.c``, a CPython
extension module built the same way where Python's headers are installed, which makes a job's calls
on the engine's thread (admission and hand-off; wait, result taken with its release, and uncount) without
ctypes' per-argument conversions (:func:`front`).

Owns the build: the library is compiled once per source version into the cache directory
(``KVOFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvoffload``, else ``~/.cache/kvoffload``) under a
name that carries the source's hash, written to a temporary name and renamed, so that concurrent
processes never load a half-written file (a build killed before its rename leaves its temporary
file, which a later build removes once it is :data:`ABANDONED_AFTER_S` old). It needs a C compiler (``$CC``, else ``cc`` or ``gcc``)
and POSIX threads, nothing of CUDA: the driver's entry points come from Python at run time
(``KVOFFLOAD_NATIVE_CFLAGS``, whitespace-separated, adds compiler flags: the CI builds both under
AddressSanitizer with it; the flags are part of the cached name). A machine
without a compiler gets :class:`~kvoffload.errors.NativeBuildError`, and a worker with
``issuer="auto"`` then issues from Python.

Also declares the C structures Python fills (:class:`Config`, :class:`PlanSpec`,
:class:`FrontSpec`) and the codes the library returns beside ``CUresult`` values.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import sysconfig
import tempfile
import time
from importlib import machinery, util
from pathlib import Path
from types import ModuleType
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload.errors import NativeBuildError

__all__ = [
    "ABANDONED",
    "ABANDONED_AFTER_S",
    "BAD_ARGUMENT",
    "JOB_FAILED",
    "BOOK_FIELDS",
    "BUILD_TIMEOUT_S",
    "CALL_KINDS",
    "CONTROL_BOOK_ANY_ORDER",
    "CONTROL_BOOK_WAIT_ITSELF",
    "CONTROL_COMING_ALWAYS",
    "CONTROL_NEVER_SIGNAL",
    "CONTROL_SKIP_SLOT_WAIT",
    "FAIL_COMPLETION",
    "FAIL_NONE",
    "FAIL_NOTHING",
    "FAIL_PARTLY",
    "JOB_DONE",
    "MEMORYTYPE_DEVICE",
    "MEMORYTYPE_HOST",
    "NO_MEMORY",
    "PATH_DMA",
    "PATH_SM",
    "PATH_STAGED",
    "PYTHON_ERROR",
    "RECORD_TOO_BIG",
    "RELEASED",
    "SOURCE",
    "TIMEOUT",
    "Config",
    "FrontSpec",
    "Memcpy2D",
    "PlanSpec",
    "address",
    "available",
    "build_front",
    "cache_dir",
    "front",
    "front_spec",
    "library",
]

_log = logging.getLogger("kvoffload.native")
SOURCE: Final = Path(__file__).with_name("issuer.c")
FRONT_SOURCE: Final = Path(__file__).with_name("front.c")
#: The call front's module name (its init function is ``PyInit_`` and this name).
FRONT_MODULE: Final = "kvoffload_front"
#: How long one compile may take before the build is given up.
BUILD_TIMEOUT_S: Final = 120.0
_FLAGS: Final = ("-O2", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra")

#: The issuing side's kinds of driver call, as ``kvo_issuer_call_stats`` orders them ("none": no
#: call in progress).
CALL_KINDS: Final = ("none", "record", "wait", "copy", "launch", "query")
# Path kinds and job states, as issuer.c numbers them.
PATH_DMA: Final = 0
PATH_SM: Final = 1
PATH_STAGED: Final = 2
JOB_DONE: Final = 2
# Kinds of failure of a done job.
FAIL_NONE: Final = 0
FAIL_PARTLY: Final = 1  # part of the job was enqueued; it completed after what was
FAIL_NOTHING: Final = 2  # nothing was enqueued
FAIL_COMPLETION: Final = 3  # the end event reported an error, or the issuer gave the job up
# kvoffload's own codes (negative: never a CUresult).
NO_MEMORY: Final = -2
RELEASED: Final = -3
ABANDONED: Final = -4
RECORD_TOO_BIG: Final = -5
TIMEOUT: Final = -6
BAD_ARGUMENT: Final = -7  # kvo_wait_layer: not a layered job, or no such layer
JOB_FAILED: Final = -8  # kvo_wait_layer: the job ended with an error (failed or given up)
#: kvo_book_fail's code for a job that failed in Python before it was handed over (its error is
#: the backend's to report).
PYTHON_ERROR: Final = -9
#: A booked job's result's int64 fields in kvo_book_take's out (id, error, failure, pairs, tag,
#: four times).
BOOK_FIELDS: Final = 9
#: CONTROL ONLY: a staging slot is rewritten without waiting for its last read (rule 5 broken on
#: purpose, for the tests that prove the rule).
CONTROL_SKIP_SLOT_WAIT: Final = 1
#: CONTROL ONLY: a hand-off never signals the thread, even when it is blocked (the idle spin's
#: wake-up rule broken on purpose).
CONTROL_NEVER_SIGNAL: Final = 2
#: CONTROL ONLY: each announcement of a caller (kvo_issuer_expect) extends the one in force, and is
#: given way to even after one lapsed with no record (the bound on a caller that announces and
#: never records, lifted).
CONTROL_COMING_ALWAYS: Final = 4
#: CONTROL ONLY: the book's take skips the jobs not done yet and takes done ones behind them (results
#: published out of hand-off order).
CONTROL_BOOK_ANY_ORDER: Final = 8
#: CONTROL ONLY: a book wait waits for the job itself, not for the first job before it not done (a
#: job booked failed behind one in flight is done at once: its waiter looks again and again).
CONTROL_BOOK_WAIT_ITSELF: Final = 16

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


class Config(ctypes.Structure):
    """``struct kvo_config``: the driver entry points, streams and path parameters of one issuer."""

    _fields_ = [
        ("ctx_set_current", _p), ("context", _p),
        ("event_create", _p), ("event_destroy", _p), ("event_record", _p), ("event_query", _p),
        ("event_elapsed", _p), ("stream_wait_event", _p), ("memcpy_async", _p), ("memcpy_batch", _p),
        ("batch_abi", _i64), ("batch_attrs", _p), ("launch", _p),
        ("functions", _p * 4), ("function_rows", _i64 * 4), ("nfunctions", _i64), ("threads", _i64),
        ("copy_stream", _p), ("kernel_stream", _p),
        ("store", _i64), ("sm_ctas", _i64), ("staged_ctas", _i64),
        ("slots", _i64), ("slot_bytes", _i64), ("slot_bases", _p),
        ("poll_min_ns", _i64), ("poll_max_ns", _i64), ("controls", _i64),
        ("wait_spin_ns", _i64), ("give_way_ns", _i64), ("idle_spin_ns", _i64),
        ("end_lead_ns", _i64), ("idle_nap_ns", _i64), ("idle_light_ns", _i64),
        ("caller_issue_max", _i64), ("ctx_get_current", _p), ("wait_query_ns", _i64),
        ("expect_spin_ns", _i64), ("memcpy_2d", _p), ("strided_min_rows", _i64), ("edge_bytes", _i64),
        ("caller_coming_ns", _i64), ("start_timeout_ns", _i64), ("piece_bytes", _i64),
        ("wait_lead_ns", _i64), ("strided_row_bytes", _i64), ("share_cpu", _i64),
    ]


#: ``CUmemorytype`` of a strided copy's side: a pinned host pointer, a device address.
MEMORYTYPE_HOST: Final = 1
MEMORYTYPE_DEVICE: Final = 2


class Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` as the driver lays it out and ``issuer.c`` declares it (``struct
    memcpy_2d``): what the thread hands ``cuMemcpy2DAsync`` for a staged chunk's rows of
    consecutive records (read by the CPU tests' fake driver and the strided-copy probe)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int32),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int32),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


class PlanSpec(ctypes.Structure):
    """``struct kvo_plan_spec``: one plan's pages, host records and kernel tables (copied by
    ``kvo_plan_new``)."""

    _fields_ = [
        ("pages", _i64),
        ("dev_base", _p), ("dev_stride", _p), ("nbytes", _p), ("host_offset", _p), ("segment", _p),
        ("record_bytes", _i64), ("host_base", _i64), ("host_stride", _i64), ("chunk_records", _i64),
        ("merge", _i64),
        ("kseg", _i64), ("kseg_rows", _i64), ("cseg", _i64), ("cseg_rows", _i64),
        ("pitch", _i64), ("runs", _i64), ("run_offset", _p), ("run_size", _p),
    ]


class FrontSpec(ctypes.Structure):
    """``struct kvo_front_spec``: what a call of the call front needs beside its arguments — the
    library's functions, one admission direction's constants (limits, counts, the duplicate check's
    scratch) or one issuer, and the last failed hand-off's code (build it with
    :func:`front_spec`)."""

    _fields_ = [
        ("admit", _p), ("hand_off", _p),
        ("src_limit", _i64), ("dst_limit", _i64),
        ("src_writes", _p), ("src_reads", _p), ("dst_reads", _p), ("dst_writes", _p), ("stamp", _p),
        ("token", _p),
        ("issuer", _p),
        ("error", _i64),
        ("unadmit", _p), ("job_take", _p), ("job_wait", _p), ("job_release", _p),
        ("expect", _p),
        ("hand_off_booked", _p), ("book_take", _p), ("book_wait", _p),
        ("marks_job", _p),
    ]


def front_spec(lib: ctypes.CDLL, **fields: int | None) -> FrontSpec:
    """A :class:`FrontSpec` with every one of ``lib``'s functions the call front calls, and
    ``fields`` (one admission direction's constants, or an issuer)."""
    functions = {name: function_address(getattr(lib, "kvo_" + name))
                 for name in ("admit", "hand_off", "unadmit", "job_take", "job_wait", "job_release")}
    functions["expect"] = function_address(lib.kvo_issuer_expect)
    for name in ("hand_off_booked", "book_take", "book_wait"):
        functions[name] = function_address(getattr(lib, "kvo_" + name))
    return FrontSpec(**functions, **fields)


def function_address(function: ctypes._FuncPointer) -> int:
    """The address of one of :func:`library`'s functions (for a :class:`FrontSpec`)."""
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


def address(ids: npt.NDArray[np.int64]) -> int:
    """The address of a writable, contiguous, non-empty id array's first element, for a call into
    the library: cheaper than ``ids.ctypes.data``, which builds an object per call."""
    return ctypes.addressof(ctypes.c_char.from_buffer(ids))  # type: ignore[arg-type]  # numpy arrays are buffers


def cache_dir() -> Path:
    """Where compiled libraries are kept (see the module docstring)."""
    configured = os.environ.get("KVOFFLOAD_CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvoffload"


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    raise NativeBuildError("no C compiler found ($CC, cc or gcc): the native library and the call front cannot be built")


def _flags() -> tuple[str, ...]:
    """The compiler flags: the library's, then those of ``KVOFFLOAD_NATIVE_CFLAGS``."""
    return (*_FLAGS, *os.environ.get("KVOFFLOAD_NATIVE_CFLAGS", "").split())


def build(directory: Path | None = None) -> Path:
    """Compile the library into ``directory`` (default: :func:`cache_dir`) unless it is there;
    returns its path.

    Raises:
        NativeBuildError: no compiler, the directory cannot be written, the compile failed (the
            message carries the compiler's output) or took longer than :data:`BUILD_TIMEOUT_S`.
    """
    return _build(SOURCE, _flags(), "kvoffload-issuer", ".so", "the native issuer", directory)


def build_front(directory: Path | None = None) -> Path:
    """Compile the call front (``front.c``) for this Python into ``directory`` (default:
    :func:`cache_dir`) unless it is there; returns its path.

    Raises:
        NativeBuildError: Python's headers are not installed (``Python.h`` under
            ``sysconfig.get_paths()["include"]``), and as :func:`build`.
    """
    include = sysconfig.get_paths().get("include") or ""
    if not (Path(include) / "Python.h").is_file():
        raise NativeBuildError(f"Python's headers are not installed (no Python.h in {include!r}): "
                               "the call front cannot be built")
    suffix = machinery.EXTENSION_SUFFIXES[0]
    return _build(FRONT_SOURCE, (*_flags(), f"-I{include}"), "kvoffload-front", suffix,
                  "the call front", directory)


def _build(source_path: Path, flags: tuple[str, ...], stem: str, suffix: str, what: str,
           directory: Path | None) -> Path:
    """Compile ``source_path`` once per source and flags (see the module docstring)."""
    source = source_path.read_bytes()
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target_dir = directory if directory is not None else cache_dir()
    target = target_dir / f"{stem}-{digest}{suffix}"
    try:
        found = target.exists()
    except OSError as exc:  # a directory on the way that cannot be searched
        raise NativeBuildError(f"cannot look for {what} in {target_dir}: {exc}") from exc
    if found:
        problem = _incomplete(target)
        if problem is None:
            return target
        _log.warning("%s at %s is not a whole shared library (%s): building it again", what, target, problem)
    compiler = _compiler()
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(target_dir, stem, suffix)
        fd, partial = tempfile.mkstemp(prefix=f".{stem}-", suffix=suffix, dir=target_dir)
        os.close(fd)
    except OSError as exc:
        raise NativeBuildError(f"cannot write {what} into {target_dir}: {exc}") from exc
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", partial, str(source_path)], capture_output=True, text=True,
            timeout=BUILD_TIMEOUT_S, check=False,
        )
        if done.returncode != 0:
            raise NativeBuildError(
                f"{compiler} could not build {what} (exit status {done.returncode}):\n"
                f"{done.stderr.strip()}"
            )
        problem = _incomplete(Path(partial))  # a full disk, or flags that make no library
        if problem is not None:
            raise NativeBuildError(f"{compiler} exited 0 but did not write a whole {what}: {problem}")
        os.chmod(partial, 0o755)  # as a linker leaves it: other users of the cache may load it
        os.replace(partial, target)
    except subprocess.TimeoutExpired as exc:
        raise NativeBuildError(f"{compiler} did not finish within {BUILD_TIMEOUT_S} s") from exc
    except OSError as exc:
        raise NativeBuildError(f"cannot build {what} with {compiler}: {exc}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


#: A temporary build file untouched for this long was left by a build that was killed (a build
#: that runs is stopped after BUILD_TIMEOUT_S and removes its own): the next build removes it.
ABANDONED_AFTER_S: Final = 2 * BUILD_TIMEOUT_S


def _remove_abandoned(target_dir: Path, stem: str, suffix: str) -> None:
    """Remove the temporary files of builds of ``stem`` killed before they could remove them; a
    file another process removes first, or one that cannot be removed, is left to it."""
    deadline = time.time() - ABANDONED_AFTER_S
    for path in target_dir.glob(f".{stem}-*{suffix}"):
        try:
            if path.stat().st_mtime < deadline:
                path.unlink()
        except OSError:
            continue


_ELF_CLASSES: Final = {1: ("I", 0x20, 0x2E, 0x30), 2: ("Q", 0x28, 0x3A, 0x3C)}  # e_shoff, e_shentsize, e_shnum


def _incomplete(path: Path) -> str | None:
    """Why ``path`` is not a whole ELF file, or None: its header, and its section header table (the
    end of what a linker writes) inside the file. Loading a file cut short (a full disk, a killed
    copy) maps pages past its end, and the first touch of one kills the process with SIGBUS."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        return str(exc)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in _ELF_CLASSES or head[5] not in (1, 2):
        return f"no ELF header ({size} bytes)"
    word, at_shoff, at_entsize, at_count = _ELF_CLASSES[head[4]]
    order = "<" if head[5] == 1 else ">"
    (shoff,) = struct.unpack_from(order + word, head, at_shoff)
    (entsize,) = struct.unpack_from(order + "H", head, at_entsize)
    (count,) = struct.unpack_from(order + "H", head, at_count)
    end = shoff + entsize * count
    if count == 0 or end > size:
        return f"cut short: {size} bytes, its section headers end at {end}"
    return None


@functools.cache
def front() -> ModuleType | None:
    """The call front, built if needed and imported once per process; None where it cannot be
    built or imported (the callers then use :func:`library`'s functions through ctypes, with the
    same results)."""
    try:
        path = build_front()
        spec = util.spec_from_file_location(FRONT_MODULE, path)
        if spec is None or spec.loader is None:
            raise NativeBuildError(f"cannot import the call front {path}")
        module = util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (NativeBuildError, ImportError, OSError) as exc:
        _log.info("the call front is not available (%s): the library is called through ctypes", exc)
        return None
    return module


@functools.cache
def available() -> ctypes.CDLL | None:
    """:func:`library`, or None where it cannot be built or loaded (asked once per process; the
    worker's admission check then runs in Python)."""
    try:
        return library()
    except NativeBuildError as exc:
        _log.info("the native library is not available (%s): admission checks run in Python", exc)
        return None


@functools.cache
def library() -> ctypes.CDLL:
    """The library, built if needed and loaded once per process, its functions typed.

    Raises:
        NativeBuildError: it could not be built or loaded.
    """
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeBuildError(f"cannot load the native issuer {path}: {exc}") from exc
    p, i64, pi64 = _p, _i64, ctypes.POINTER(_i64)
    signatures: dict[str, tuple[list[object], object]] = {
        "kvo_issuer_new": ([ctypes.POINTER(Config), pi64], p),
        "kvo_issuer_stop": ([p, i64], i64),
        "kvo_issuer_free": ([p], None),
        "kvo_plan_new": ([ctypes.POINTER(PlanSpec)], p),
        "kvo_plan_free": ([p], None),
        "kvo_fence_take": ([p, p, pi64], p),
        "kvo_fence_release": ([p, p], None),
        "kvo_hand_off": ([p, p, p, i64, i64, p, p, i64, p, i64, i64, pi64], p),
        "kvo_job_take": ([p, i64, pi64, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_char_p)], i64),
        "kvo_job_wait": ([p, i64], i64),
        "kvo_job_release": ([p], None),
        "kvo_job_times": ([p, pi64], None),
        "kvo_issuer_counts": ([p, pi64], None),
        "kvo_issuer_direct_copies": ([p], i64),
        "kvo_issuer_yields": ([p, pi64], None),
        "kvo_issuer_call_stats": ([p, pi64], None),
        "kvo_issuer_expect": ([p], i64),
        "kvo_job_expected_end": ([p], i64),
        "kvo_wait_layer": ([p, i64, p, i64], i64),
        "kvo_admit": ([p, p, i64, i64, i64, p, p, p, p, p, pi64], i64),
        "kvo_unadmit": ([p, p, i64, p, p], None),
        "kvo_marks_release": ([p], None),
        "kvo_hand_off_booked": ([p, i64, i64, p, p, i64, i64, p, p, i64, p, i64, i64, ctypes.POINTER(p)], i64),
        "kvo_book_fail": ([p, i64, i64, i64], i64),
        "kvo_book_take": ([p, i64, pi64, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_char_p)], i64),
        "kvo_book_wait": ([p, i64, i64, i64], i64),
        "kvo_book_count": ([p, pi64], i64),
        "kvo_book_times": ([p, i64, pi64], i64),
    }
    for name, (argtypes, restype) in signatures.items():
        try:
            function = getattr(lib, name)
        except AttributeError as exc:  # another library under the name
            raise NativeBuildError(f"the native issuer {path} lacks {name}: {exc}") from exc
        function.argtypes = argtypes
        function.restype = restype
    return lib
