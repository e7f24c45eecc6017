"""Every command refuses a bad flag value the same way: argparse's usage error (exit status 2), one
line on stderr that names the flag, before any work is done; never a traceback, a hang or a file left
behind. And ``bench --ranks``, stopped by SIGTERM while its ranks attach, removes its pool's file."""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import kvoffload.__main__ as command_table
from kvoffload.cli import _args, bench, demo, manager_bench, replay
from kvoffload.cli._caches import block_bytes
from kvoffload.cli._replay_model import DTYPES
from kvoffload.integrations import transformers_demo

REPO = pathlib.Path(__file__).resolve().parents[2]
GPU = torch.cuda.is_available()
HUGE = "99999999999999"
#: Small sizes, so that a value that is wrongly accepted fails fast instead of running for minutes.
DEMO = ["--device-blocks", "16", "--host-blocks", "8", "--blocks-per-job", "4", "--link-bytes", "4096",
        "--layers", "2", "--quiet"]
REPLAY = ["--quiet", "--requests", "5", "--layers", "2"]
ON_CPU_ONLY = pytest.mark.skipif(GPU, reason="refused only where torch sees no CUDA device")


def refused(main: Callable[[Sequence[str]], object], argv: Sequence[str], flag: str,
            capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``main(argv)``, expect argparse's usage error naming ``flag``; the error line."""
    with pytest.raises(SystemExit) as caught:
        main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert ": error: " in line and flag in line, err
    return line


DEMO_CASES = [
    (["--layers", "0"], "--layers"), (["--layers", "-1"], "--layers"),
    (["--device-blocks", "0"], "--device-blocks"), (["--device-blocks", "-5"], "--device-blocks"),
    (["--host-blocks", "-1"], "--host-blocks"), (["--host-blocks", HUGE], "--host-blocks"),
    (["--kv-heads", "-2"], "--kv-heads"), (["--kv-heads", "0"], "--kv-heads"),
    (["--head-dim", "0"], "--head-dim"), (["--block-size", "0"], "--block-size"),
    (["--block-size", "-1"], "--block-size"), (["--blocks-per-job", "0"], "--blocks-per-job"),
    (["--blocks-per-job", "-4"], "--blocks-per-job"), (["--blocks-per-job", "1000"], "--blocks-per-job"),
    (["--link-bytes", "0"], "--link-bytes"), (["--link-bytes", "-1"], "--link-bytes"),
    (["--link-bytes", HUGE], "--link-bytes"), (["--seed", "99999999999999999999999"], "--seed"),
    (["--dtype", "int8"], "--dtype"), (["--layout", "bogus"], "--layout"),
    pytest.param(["--backend", "cuda"], "--backend", marks=ON_CPU_ONLY),
    pytest.param(["--backend", "host", "--path", "sm"], "--path"),
]


@pytest.mark.parametrize(("argv", "flag"), DEMO_CASES)
def test_demo_refuses(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(demo.main, [*DEMO, *argv], flag, capsys)
    assert capsys.readouterr().out == ""  # not even the host backend's notice: nothing ran


REPLAY_CASES = [
    (["--layers", "0"], "--layers"), (["--kv-heads", "-1"], "--kv-heads"),
    (["--device-blocks", "0"], "--device-blocks"), (["--device-blocks", "99999999999"], "--device-blocks"),
    (["--host-blocks", "99999999999"], "--host-blocks"), (["--requests", "-1"], "--requests"),
    (["--max-seconds", "nan"], "--max-seconds"), (["--max-seconds", "inf"], "--max-seconds"),
    (["--max-seconds", "-1"], "--max-seconds"), (["--zipf", "nan"], "--zipf"), (["--zipf", "inf"], "--zipf"),
    (["--continue-prob", "nan"], "--continue-prob"), (["--prefill-tokens-per-s", "inf"], "--prefill-tokens-per-s"),
    (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s"), (["--seed", "-1"], "--seed"),
    (["--stall-cycles-per-block", "-1"], "--stall-cycles-per-block"),
    (["--remote-mib", "0"], "--remote-mib"), (["--json", "/nonexistent/x.json"], "--json"),
    (["--json", ""], "--json"), (["--backend", "host", "--path", "sm"], "--path"),
    (["--remote", "redis", "--remote-address", "bogus", "--instance-only"], "--remote-address"),
    (["--remote", "mooncake", "--remote-address", "host:0", "--instance-only"], "--remote-address"),
    pytest.param(["--backend", "cuda"], "--backend", marks=ON_CPU_ONLY),
    pytest.param(["--stall-cycles-per-block", "1"], "--stall-cycles-per-block", marks=ON_CPU_ONLY),
]


@pytest.mark.parametrize(("argv", "flag"), REPLAY_CASES)
def test_replay_refuses(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(replay.main, [*REPLAY, *argv], flag, capsys)


def test_replay_json_path_is_checked_before_the_run(tmp_path: pathlib.Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    refused(replay.main, [*REPLAY, "--json", str(tmp_path / "missing" / "x.json")], "--json", capsys)
    refused(replay.main, [*REPLAY, "--json", str(tmp_path)], "--json", capsys)
    assert list(tmp_path.iterdir()) == []


BENCH_CASES = [
    (["--pages", "abc"], "--pages"), (["--pages", "-4"], "--pages"), (["--pages", "4,0"], "--pages"),
    (["--paths", "auto,bogus"], "--paths"), (["--paths", ""], "--paths"), (["--total-mib", "-1"], "--total-mib"),
    (["--kernel-ctas", "0"], "--kernel-ctas"), (["--issuers", "bogus", "--latency"], "--issuers"),
    (["--layers", "-3", "--layerwise"], "--layers"), (["--layers", "3"], "--layers"),
    (["--compute", "0", "--layerwise"], "--compute"), (["--compute", "nan", "--layerwise"], "--compute"),
    (["--compute", "2"], "--compute"), (["--compute", "2", "--latency"], "--compute"),
    (["--rounds", "0"], "--rounds"), (["--rounds", "abc"], "--rounds"), (["--rounds", "101"], "--rounds"),
    (["--latency", "--rounds", "3"], "--rounds"), (["--disk", ".", "--rounds", "3"], "--rounds"),
    (["--latency", "--gemm"], "--gemm"), (["--latency", "--paths", "loop"], "--paths"),
    (["--json", "/nonexistent/x.json"], "--json"), (["--disk", "/nonexistent"], "--disk"),
    (["--disk", ".", "--total-mib", "-5"], "--total-mib"), (["--disk", ".", "--latency"], "--latency"),
    (["--disk", ".", "--gemm"], "--gemm"), (["--disk", ".", "--json", "/nonexistent/x.json"], "--json"),
    (["--ranks", "0"], "--ranks"), (["--ranks", "-1"], "--ranks"), (["--ranks", "abc"], "--ranks"),
    (["--ranks", "2", "--traffic-ranks", "-1"], "--traffic-ranks"), (["--ranks", "2", "--pool-gib", "0"], "--pool-gib"),
    (["--ranks", "2", "--pool-gib", "-1"], "--pool-gib"), (["--ranks", "2", "--pool-gib", "nan"], "--pool-gib"),
    (["--ranks", "2", "--pool-gib", "99999"], "--pool-gib"), (["--ranks", "2", "--page-kib", "0"], "--page-kib"),
    (["--ranks", "2", "--page-kib", "3"], "--page-kib"), (["--ranks", "2", "--path", "bogus"], "--path"),
    (["--ranks", "2", "--traffic-mib", "0"], "--traffic-mib"),
    (["--ranks", "2", "--traffic-mib", HUGE], "--traffic-mib"),
    (["--ranks", "2", "--json", "/nonexistent/x.json"], "--json"),
    (["--remote", "bogus"], "--remote"), (["--remote", "redis", "--records", "0"], "--records"),
    (["--remote", "redis", "--record-mib", "0"], "--record-mib"), (["--remote", "redis", "--batch", "0"], "--batch"),
    (["--remote", "redis", "--rounds", "0"], "--rounds"),
    (["--remote", "redis", "--checksum-threads", "-1"], "--checksum-threads"),
    (["--remote", "redis", "--nodes", ""], "--nodes"), (["--remote", "redis", "--nodes", "bogus"], "--nodes"),
    (["--remote", "redis", "--master", "127.0.0.1:1"], "--master"),
    (["--remote", "mooncake", "--nodes", "127.0.0.1:1"], "--nodes"),
    (["--remote", "redis", "--json", "/nonexistent/x.json"], "--json"),
    (["--remote", "redis", "--records", HUGE], "--records"),
]


@pytest.mark.parametrize(("argv", "flag"), BENCH_CASES)
def test_bench_refuses(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(bench.main, argv, flag, capsys)


ENGINE_DEMO_CASES = [
    (["--device", "bogus"], "--device"), (["--device", ""], "--device"), (["--page-size", "0"], "--page-size"),
    (["--prefix-tokens", "-5"], "--prefix-tokens"), (["--new-tokens", "0"], "--new-tokens"),
    (["--heads", "3"], "--heads"), (["--kv-heads", "3"], "--kv-heads"), (["--vocab", "1"], "--vocab"),
    (["--layers", "0"], "--layers"), (["--max-batch-tokens", "0"], "--max-batch-tokens"),
    (["--prefixes", "0"], "--prefixes"), (["--return-rounds", "0"], "--return-rounds"),
    (["--decode-requests", "-1"], "--decode-requests"), (["--vocab", HUGE], "--vocab"),
    (["--size", "huge"], "--size"),
    pytest.param(["--device", "cuda"], "--device", marks=ON_CPU_ONLY),
    pytest.param(["--device", "cuda:7"], "--device", marks=ON_CPU_ONLY),
]


@pytest.mark.parametrize(("argv", "flag"), ENGINE_DEMO_CASES)
def test_engine_demo_refuses(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    refused(lambda a: transformers_demo.main(a, out=out), ["--device", "cpu", *argv], flag, capsys)
    assert out.getvalue() == ""


def test_engine_demo_says_the_engine_stopped_instead_of_waiting() -> None:
    class Stopped:
        def add_request(self, prompt: list[int], **kwargs: Any) -> str:
            return "r0"

        def get_result(self, **kwargs: Any) -> None:
            return None

        def is_running(self) -> bool:
            return False

    began = time.monotonic()
    with pytest.raises(RuntimeError, match="the engine stopped"):
        transformers_demo._request(Stopped(), [3, 4], 1)
    assert time.monotonic() - began < transformers_demo.RESULT_TIMEOUT_S / 10


def test_manager_bench_refuses_and_names_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(lambda a: manager_bench.main(list(a)), ["--bogus"], "--bogus", capsys)
    assert line.startswith("python -m kvoffload manager-bench: error:")
    assert "python -m kvoffload manager-bench" in (manager_bench.__doc__ or "")


def test_no_command_is_a_usage_error_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert command_table.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: python -m kvoffload" in captured.err
    assert command_table.main(["bogus"]) == 2 and "bogus" in capsys.readouterr().err


@pytest.mark.parametrize(("helper", "text", "message"), [
    (_args.int_in(1, 3), "4", "4 must be in [1, 3]"),
    (_args.int_in(0), "x", "'x' is not an integer"),
    (_args.finite_float(0, low_open=True), "0", "0 must be a finite number > 0"),
    (_args.finite_float(0), "nan", "nan must be a finite number >= 0"),
    (_args.names(("a", "b")), "a,c", "('c' is not)"),
    (_args.int_list(1, 8), "4,9", "'4,9': 9 must be in [1, 8]"),
    (_args.host_ports, "h:1,h", "'h' must be HOST:PORT"),
    (_args.host_port, "h:65536", "must be HOST:PORT"),
])
def test_each_helper_names_the_value_and_the_rule(helper: Callable[[str], object], text: str,
                                                  message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        helper(text)
    assert message in str(caught.value)


def test_the_helpers_return_good_values_unchanged() -> None:
    assert _args.int_in(1)("7") == 7 and _args.finite_float(0, 1)("0.5") == 0.5
    assert _args.names(("a", "b"))("b,a") == ("b", "a") and _args.int_list(1, 8)("4,8") == (4, 8)
    assert _args.host_ports("h:1,[::1]:2") == (("h", 1), ("::1", 2))


def _pool_files(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"kvoffload-bench-{pid}-")]


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*/children"):
        found.update(int(c) for c in task.read_text().split())
    return found


def _running(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_ranks_bench_stopped_by_sigterm_while_ranks_attach_leaves_no_pool_file() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload", "bench", "--ranks", "2", "--pool-gib", "1", "--traffic-ranks", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 120
        while not _pool_files(proc.pid):  # a rank is attaching: the pool's file exists
            assert proc.poll() is None and time.monotonic() < deadline, "no pool file appeared"
            time.sleep(0.002)
        ranks = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "leaked" not in err, err
    assert _pool_files(proc.pid) == []
    deadline = time.monotonic() + 30  # the ranks were killed; multiprocessing's tracker exits after them
    while any(_running(child) for child in ranks):
        assert time.monotonic() < deadline, [child for child in ranks if _running(child)]
        time.sleep(0.1)


def test_replay_counts_the_space_of_a_tier_file_it_will_size_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """(A rerun on the file of an earlier run was refused: the file's own space was not counted.)"""
    parser = argparse.ArgumentParser(prog="replay")
    replay.add_arguments(parser)
    path = tmp_path / "tier"
    args = parser.parse_args([*REPLAY, "--disk-path", str(path), "--disk-blocks", "64"])
    block = block_bytes(args.layout, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        block_size=args.block_size, dtype=DTYPES[args.dtype])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=32 * block))
    with pytest.raises(SystemExit):
        replay.check_arguments(parser, args)
    assert "--disk-blocks" in capsys.readouterr().err
    with open(path, "wb") as f:
        f.truncate(40 * block)  # sparse: no space comes back
    with pytest.raises(SystemExit):
        replay.check_arguments(parser, args)
    capsys.readouterr()
    with open(path, "wb") as f:
        f.write(bytes(40 * block))  # the earlier run's file, written
    replay.check_arguments(parser, args)  # 32 + 40 blocks of room
