"""``python -m kvoffload bench --disk DIR``: it fits the machine's memory, writes ``--json``, names
the flag the user typed, and leaves no file behind on any exit, a SIGTERM included."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvoffload.cli import bench, disk_bench
from kvoffload.region import host_memory_available

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_data_size_is_capped_by_the_memory_available() -> None:
    available = host_memory_available()
    if available is None:
        pytest.skip("this platform reports no available memory")
    huge = 4 * available[0]
    fitted = disk_bench.fit_to_memory(huge, 1 << 30, cpu_cache=True)
    assert fitted < huge and 3 * fitted + (2 << 30) <= available[0] * disk_bench.MEMORY_SHARE + 1
    assert disk_bench.fit_to_memory(64 << 20, 1 << 20, cpu_cache=True) == 64 << 20


def test_a_run_writes_its_json_and_leaves_no_file(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "figures.json"
    status = bench.main(["--disk", str(data), "--quick", "--total-mib", "16", "--json", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    assert report["pipeline"]["mismatched_blocks"] == 0 and report["rows"][0]["name"] == "raw"
    assert list(data.iterdir()) == []


def test_a_missing_directory_is_named_by_the_flag_the_user_typed(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--disk", str(tmp_path / "nowhere")])
    error = capsys.readouterr().err.splitlines()[-1]
    assert "error: --disk" in error and "--path" not in error


def test_sigterm_removes_the_benchmark_files(tmp_path: pathlib.Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload", "bench", "--disk", str(tmp_path), "--total-mib", "256"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 60
        while not any(tmp_path.iterdir()):  # wait until it created a file
            assert proc.poll() is None and time.monotonic() < deadline, "no benchmark file appeared"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("direct", [True, False])
def test_a_signal_as_the_raw_files_open_returns_leaves_no_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, direct: bool,
) -> None:
    """SIGTERM's handler raises in the main thread at the next bytecode that looks for signals,
    which may be the return of the ``open`` that made the raw pass's file: the file goes too (it was
    left behind when the open stood before the ``try`` that removes it; CI saw it once). Without
    O_DIRECT, the second open (after the first one's ``OSError``) is the one interrupted."""
    path = tmp_path / "kvoffload-bench-raw-1.bin"
    real_open = os.open
    opened: list[int] = []

    def open_then_signal(name: str, flags: int, mode: int = 0o777) -> int:
        if not direct and not opened and flags & getattr(os, "O_DIRECT", 0):
            opened.append(-1)
            raise OSError("O_DIRECT refused")
        opened.append(real_open(name, flags, mode))
        raise disk_bench._Terminated(signal.SIGTERM)

    monkeypatch.setattr(os, "open", open_then_signal)
    try:
        with pytest.raises(disk_bench._Terminated):
            disk_bench._raw(str(path), 1 << 20, 1 << 20, 1)
    finally:
        monkeypatch.undo()
        for fd in opened:
            if fd >= 0:
                os.close(fd)
    assert opened and opened[-1] >= 0
    assert not path.exists()


def test_a_raw_file_that_was_there_before_is_refused_and_left_alone(tmp_path: pathlib.Path) -> None:
    """Another's file under the raw pass's name (another host's run with the same pid on a shared
    directory): the pass fails at its open and never removes it."""
    path = tmp_path / "kvoffload-bench-raw-1.bin"
    path.write_bytes(b"theirs")
    with pytest.raises(FileExistsError):
        disk_bench._raw(str(path), 1 << 20, 1 << 20, 1)
    assert path.read_bytes() == b"theirs"


def test_a_file_left_by_a_killed_run_is_removed_by_the_next(tmp_path: pathlib.Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / f"kvoffload-bench-tier-{int(dead.stdout)}.bin"
    stale.write_bytes(b"x" * 4096)
    mine = tmp_path / "keep-me.bin"
    mine.write_bytes(b"y")
    disk_bench._sweep_stale_files(str(tmp_path))
    assert not stale.exists() and mine.exists()


def test_a_measurement_whose_threads_do_not_finish_raises_by_its_deadline() -> None:
    release = threading.Event()

    def work(k: int) -> None:
        if k == 1:
            assert release.wait(30.0)  # a disk that stopped answering, until the test lets it go

    began = time.monotonic()
    try:
        with pytest.raises(disk_bench.StuckThreadsError, match=r"1 of 2 threads did not finish within 0\.2 s"):
            disk_bench._timed_threads(work, 2, 1 << 20, deadline_s=0.2)
        assert time.monotonic() - began < 10.0
    finally:
        release.set()
    assert disk_bench._timed_threads(lambda k: None, 2, 1 << 20, deadline_s=10.0) > 0


def test_a_raw_run_whose_write_does_not_return_keeps_its_file_descriptor_for_the_stuck_thread(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    real_pwritev = os.pwritev
    fds: list[int] = []

    def stuck_pwritev(fd: int, buffers: object, offset: int) -> int:
        fds.append(fd)
        assert release.wait(30.0)  # the disk stopped answering, until the test lets it go
        return real_pwritev(fd, buffers, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_bench, "WAIT_S", 0.3)
    monkeypatch.setattr(os, "pwritev", stuck_pwritev)
    path = tmp_path / "kvoffload-bench-raw-stuck.bin"
    try:
        with pytest.raises(disk_bench.StuckThreadsError, match=r"1 of 1 threads did not finish within 0\.3 s"):
            disk_bench._raw(str(path), 1 << 20, 1 << 20, 1)
        assert len(fds) == 1
        os.fstat(fds[0])  # still open: the stuck thread's write never lands on another file
        assert not path.exists()
    finally:
        release.set()
        stuck = [t for t in threading.enumerate() if t.name.startswith("kvoffload-bench-io-")]
        for t in stuck:
            t.join(10.0)
        monkeypatch.undo()
        for fd in fds[:1]:
            os.close(fd)
    assert not any(t.is_alive() for t in stuck)
