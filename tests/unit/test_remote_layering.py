"""kvoffload.remote sits beside the core: it imports only the lowest layers, and nothing imports it.

The store clients (``mooncake``, ``redis``) are optional extras: no module imports them at load time,
so ``import kvoffload.remote`` works without either installed.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kvoffload"
REMOTE = PACKAGE / "remote"
ALLOWED_CORE = {"kvoffload.errors", "kvoffload.records", "kvoffload._record"}


def imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", sorted(REMOTE.glob("*.py")), ids=lambda p: p.stem)
def test_remote_modules_import_only_the_lowest_core_layers(path: pathlib.Path) -> None:
    for module in imports(path):
        if module.startswith("kvoffload.") and not module.startswith("kvoffload.remote"):
            assert module in ALLOWED_CORE, f"{path.name} imports {module}"
        assert module.split(".")[0] not in {"mooncake", "redis", "torch"}, f"{path.name} imports {module} at load time"


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.stem)
def test_the_core_does_not_import_the_remote_tier(path: pathlib.Path) -> None:
    assert not any(m.startswith("kvoffload.remote") for m in imports(path)), path.name


def test_the_remote_package_loads_without_its_extras() -> None:
    code = (
        "import sys\n"
        "sys.modules['mooncake'] = None; sys.modules['redis'] = None\n"
        "import kvoffload.remote\n"
        "import numpy as np\n"
        "from kvoffload.errors import RemoteUnavailableError\n"
        "try:\n"
        "    kvoffload.remote.MooncakeStore.create(kvoffload.remote.MooncakeConfig('127.0.0.1:1'),\n"
        "        host_rows=np.zeros((1, 4096), np.uint8), fingerprint='f')\n"
        "except RemoteUnavailableError as e:\n"
        "    assert 'kvoffload[mooncake]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
