"""Every Python example in README.md runs as it is written (on the CPU here: the examples choose
the device themselves), so the documentation cannot promise what the code does not do."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_examples() -> list[tuple[int, str]]:
    """``(line, code)`` of every fenced ``python`` block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def test_the_readme_has_python_examples() -> None:
    assert len(python_examples()) >= 2


@pytest.mark.parametrize(("line", "code"), python_examples(), ids=lambda v: f"line-{v}" if isinstance(v, int) else "")
def test_readme_example_runs(line: int, code: str) -> None:
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": f"readme_example_{line}"})
