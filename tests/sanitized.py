"""The native library's CPU tests with the library built under AddressSanitizer (``python -m
tests.sanitized``, a step of ``.ci/run``).

The issuer's C is exercised by tests/unit/test_native_issuer.py, tests/unit/test_direct_copies.py,
tests/unit/test_call_front.py, tests/unit/test_copy_pieces.py, tests/unit/test_expedited_loads.py
and tests/unit/test_layer_groups.py over the fake driver, and
tests/unit/test_share_cpu.py over a no-op C driver; a use-after-free there (a job freed by its last
reference while a thread still reads it) passes those tests unseen. Here the library and the call front are compiled with
``-fsanitize=address`` (``KVOFFLOAD_NATIVE_CFLAGS``) into a temporary cache (removed afterwards),
the sanitizer's runtime is preloaded into a fresh interpreter (it must be loaded first), and any
report fails the run: the
reports go to files, since pytest captures the process's stderr and a report ends the process.
Exit status: pytest's, or 1 when the sanitizer reported anything.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

TESTS = ("tests/unit/test_native_issuer.py", "tests/unit/test_direct_copies.py", "tests/unit/test_call_front.py", "tests/unit/test_copy_pieces.py",
         "tests/unit/test_expedited_loads.py", "tests/unit/test_layer_groups.py", "tests/unit/test_share_cpu.py")
#: How long the sanitized run may take (it takes about 20 s on the CI machine).
TIMEOUT_S = 900


def _runtime() -> str:
    """The path of the C compiler's AddressSanitizer runtime."""
    compiler = os.environ.get("CC") or "cc"
    found = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True,
                           check=True, timeout=60).stdout.strip()
    if not os.path.isabs(found):
        raise SystemExit(f"{compiler} has no AddressSanitizer runtime (libasan.so)")
    return found


def main() -> int:
    """Run the tests under the sanitizer in a fresh interpreter; print any report; 1 on one."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-asan-") as scratch:
        env = dict(os.environ, LD_PRELOAD=_runtime(), KVOFFLOAD_CACHE_DIR=f"{scratch}/cache",
                   KVOFFLOAD_NATIVE_CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g",
                   ASAN_OPTIONS=f"detect_leaks=0:log_path={scratch}/report")
        done = subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider"],
                              env=env, timeout=TIMEOUT_S, check=False)
        reports = sorted(glob.glob(f"{scratch}/report*"))
        for path in reports:
            with open(path, encoding="utf-8", errors="replace") as report:
                sys.stderr.write(report.read())
        if reports:
            print(f"AddressSanitizer reported {len(reports)} error(s)", file=sys.stderr)
            return 1
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
