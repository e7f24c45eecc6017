"""``python -m kvoffload engine-demo`` on the CPU: the three runs finish, every token matches, and the
figures are printed (their values are measured, never asserted)."""

from __future__ import annotations

import io

from tests.unit._cb_workload import require_transformers

require_transformers()

from kvoffload.integrations import transformers_demo  # noqa: E402


def test_engine_demo_runs_the_three_runs_and_matches_every_token() -> None:
    out = io.StringIO()
    status = transformers_demo.main(
        ["--device", "cpu", "--size", "tiny", "--prefixes", "2", "--decode-tokens", "16", "--return-rounds", "2"],
        out=out,
    )
    text = out.getvalue()
    assert status == 0, text
    # 2 prefills, 4 decodes, and per round a filler and 2 returning requests, all compared
    assert "recompute vs offload 12/12" in text, text
    assert "TTFT return (median of 4, ms)" in text, text
    for line in ("TTFT host hit / recompute", "TTFT host hit / GPU-cache hit",
                 "decode tok/s with offload / without", "OK: generated tokens identical"):
        assert line in text, text
    stats = next(line for line in text.splitlines() if line.startswith("offload stats:"))
    assert "blocks_loaded_host=0," not in stats and "blocks_load_failed=0," in stats, stats


def test_engine_demo_refuses_a_bad_option() -> None:
    try:
        transformers_demo.main(["--size", "huge"], out=io.StringIO())
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--size huge was accepted")


def test_engine_demo_refuses_no_return_round() -> None:
    try:
        transformers_demo.main(["--device", "cpu", "--return-rounds", "0"], out=io.StringIO())
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--return-rounds 0 was accepted")
