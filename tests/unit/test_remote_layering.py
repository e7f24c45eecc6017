"""kvoffload.remote stands on the lowest layers; only the worker composes it into the core.

The store clients (``mooncake``, ``redis``) are optional extras: no module imports them at load time,
so ``import kvoffload.remote`` (and a worker without a remote tier) works without either installed.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kvoffload"
REMOTE = PACKAGE / "remote"
ALLOWED_CORE = {"kvoffload.errors", "kvoffload.records", "kvoffload._record", "kvoffload._jobs", "kvoffload._seconds"}
#: The core modules that compose the remote tier (the worker) or name it on the public surface.
COMPOSERS = {"worker/assembly.py", "worker/worker.py", "__init__.py"}


def imports(path: pathlib.Path, *, runtime_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


@pytest.mark.parametrize(
    "path", sorted(p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(REMOTE)),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_only_the_worker_composes_the_remote_tier(path: pathlib.Path) -> None:
    name = str(path.relative_to(PACKAGE))
    if name in COMPOSERS or name.startswith(("cli/", "testing/", "integrations/")):
        return  # the composition, and the tools on the public surface
    assert not any(m.startswith("kvoffload.remote") for m in imports(path)), name


def test_the_public_surface_names_the_remote_tier_lazily() -> None:
    assert not any(m.startswith("kvoffload.remote") for m in imports(PACKAGE / "__init__.py", runtime_only=True))


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
