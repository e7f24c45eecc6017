"""The auto path's calibration record on CPU: bucket lookup and persistence across processes."""

from __future__ import annotations

import json
import pathlib

from kvoffload.calibration import SM_BUCKETS, AutoChoice, _fastest, _load, _save
from kvoffload.records import Direction


def choice(key: str = "H200|2097152|32768") -> AutoChoice:
    return AutoChoice(
        key=key,
        buckets=(1, 8, 32),
        paths={"store": ("dma", "staged", "staged"), "load": ("dma", "dma", "staged")},
        gbps={"store": {"dma": (5.0, 20.0, 30.0), "staged": (4.0, 30.0, 50.0)},
              "load": {"dma": (6.0, 25.0, 30.0), "staged": (3.0, 20.0, 50.0)}},
    )


def test_a_job_takes_the_bucket_of_the_largest_size_not_above_it() -> None:
    c = choice()
    assert [c.path_for(Direction.STORE, n) for n in (1, 7, 8, 31, 32, 10_000)] == [
        "dma", "dma", "staged", "staged", "staged", "staged"]
    assert [c.path_for(Direction.LOAD, n) for n in (1, 8, 31, 32)] == ["dma", "dma", "dma", "staged"]


def test_a_saved_choice_is_read_back_for_its_key_only(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "calibration.json")
    _save(path, choice())
    _save(path, choice("other|4096|4096"))
    assert _load(path, choice().key) == choice()
    assert _load(path, "unknown|1|1") is None
    assert set(json.loads(pathlib.Path(path).read_text())["choices"]) == {choice().key, "other|4096|4096"}


def test_a_damaged_or_foreign_file_is_ignored(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    assert _load(str(path), choice().key) is None
    path.write_text(json.dumps({"version": 99, "choices": {}}))
    assert _load(str(path), choice().key) is None
    _save(str(path), choice())  # a damaged file is replaced, not fatal
    assert _load(str(path), choice().key) == choice()


def test_sm_competes_only_in_the_smallest_bucket() -> None:
    measured: dict[str, tuple[float, ...]] = {
        "dma": (5.0, 20.0, 30.0), "staged": (4.0, 30.0, 50.0), "sm": (9.0, 90.0, 90.0)}
    assert SM_BUCKETS == 1
    assert [_fastest(measured, i) for i in range(3)] == ["sm", "staged", "staged"]
    slow_sm: dict[str, tuple[float, ...]] = {"dma": (5.0, 1.0, 1.0), "sm": (4.0, 0.0, 0.0)}
    assert _fastest(slow_sm, 0) == "dma"
    no_bulk: dict[str, tuple[float, ...]] = {"dma": (0.0, 0.0, 0.0), "sm": (4.0, 0.0, 0.0)}
    assert _fastest(no_bulk, 1) == "dma"
