"""Two engine instances share hits through the store: instance A (one process) stores blocks and
writes them through; instance B (another process, an empty host pool) finds them, loads them and
checks every byte. Then the same through ``python -m kvoffload replay --remote``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.remote.conftest import Cluster

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


def last_json(out: str) -> dict[str, int]:
    line = [x for x in out.splitlines() if x.startswith("{")][-1]
    data: dict[str, int] = json.loads(line)
    return data


def test_instance_b_finds_and_verifies_every_block_instance_a_stored(cluster: Cluster, prefix: str) -> None:
    common = ["--backend", cluster.backend, "--address", cluster.address, "--prefix", prefix, "--blocks", "24"]
    writer = run("-m", "tests.remote._instance", "writer", *common)
    assert writer.returncode == 0, writer.stdout + writer.stderr
    assert last_json(writer.stdout) == {"stored": 24, "put": 24}
    reader = run("-m", "tests.remote._instance", "reader", *common)
    assert reader.returncode == 0, reader.stdout + reader.stderr
    counts = last_json(reader.stdout)
    assert counts == {"looked_up": 24, "hits": 24, "remote_hits": 24, "verified": 24, "corrupted": 0,
                      "ok": 1, "remote_lookup_hits": 24}


def test_replay_remote_runs_two_instances_that_share_hits(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    report = tmp_path / "replay.json"
    done = run("-m", "kvoffload", "replay", "--remote", cluster.backend, "--remote-address", cluster.address,
               "--backend", "host", "--blocks-to-load", "600", "--layers", "1", "--kv-heads", "2",
               "--head-dim", "64", "--quiet", "--json", str(report))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    a, b = data["report"], data["instance_b"]
    assert a["ok"] and b["ok"]
    assert b["hits_by_tier"]["remote"] > 0 and b["corrupted_blocks"] == 0 and a["corrupted_blocks"] == 0
    assert a["remote_put_blocks"] > 0
    assert "two instances: B read" in done.stdout


def test_replay_reports_an_unreachable_store_in_one_line() -> None:
    """(Four chained tracebacks before.) Nothing listens on port 1; in this suite, where the Redis
    client is installed."""
    done = run("-m", "kvoffload", "replay", "--quiet", "--requests", "5", "--layers", "2", "--remote", "redis",
               "--remote-address", "127.0.0.1:1", "--instance-only")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "RemoteUnavailableError" in lines[0], done.stderr
