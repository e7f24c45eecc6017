"""The layers of DESIGN §3 depend downward only, and only the bindings layer imports cuda-python.

Each module of the package has a rank; a module may import only modules of a lower rank (or the
same module's own private helpers listed with the same rank). RegionOwner and DirectionHandler are
siblings: neither imports the other. The manager is scheduler-side and imports no torch or CUDA.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kvoffload"

RANKS: dict[str, int] = {
    "errors": 0,
    "records": 0,
    "bindings": 1,
    "_descriptors": 1,
    "manager": 1,
    "layout": 2,
    "backends": 2,
    "region": 3,
    "handler": 3,
    "disk": 4,
    "calibration": 4,
    "_pipeline": 5,
    "_caches": 5,
    "worker": 6,
    "testing": 7,
    "demo": 7,
    "bench": 8,
    "replay": 7,
    "disk_bench": 7,
    "manager_bench": 7,
    "integrations": 8,
    "__main__": 9,
    "__init__": 9,
}
CUDA_MODULES = {"bindings"}
TORCH_FREE = {"errors", "records", "bindings", "_descriptors", "manager"}


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.level:
                raise AssertionError(f"{path.name} uses a relative import; use kvoffload.<module>")
            if node.module != "kvoffload":
                found.add(node.module)
                continue
            for alias in node.names:  # a submodule, or a name from the package's __init__
                found.add(f"kvoffload.{alias.name}" if alias.name in RANKS else "kvoffload")
    return found


def package_modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.glob("*.py"))


def test_every_module_has_a_rank() -> None:
    names = {p.stem for p in package_modules()}
    assert names <= set(RANKS), f"give these modules a rank: {sorted(names - set(RANKS))}"


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: p.stem)
def test_module_imports_only_lower_layers(path: pathlib.Path) -> None:
    me = path.stem
    for module in imported_modules(path):
        if not module.startswith("kvoffload.") and module != "kvoffload":
            continue
        target = module.split(".")[1] if "." in module else "__init__"
        assert target in RANKS, f"{me} imports {module}, which has no rank"
        assert RANKS[target] < RANKS[me], f"{me} (rank {RANKS[me]}) imports {target} (rank {RANKS[target]})"


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: p.stem)
def test_only_the_bindings_import_cuda_python(path: pathlib.Path) -> None:
    uses_cuda = any(m == "cuda" or m.startswith("cuda.") for m in imported_modules(path))
    assert not uses_cuda or path.stem in CUDA_MODULES, f"{path.stem} imports cuda-python"


@pytest.mark.parametrize("name", sorted(TORCH_FREE))
def test_lowest_layers_and_the_manager_do_not_import_torch(name: str) -> None:
    path = PACKAGE / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{name}.py does not exist yet")
    assert not any(m == "torch" or m.startswith("torch.") for m in imported_modules(path))


def test_region_and_handler_are_siblings() -> None:
    assert "kvoffload.handler" not in imported_modules(PACKAGE / "region.py")
    assert "kvoffload.region" not in imported_modules(PACKAGE / "handler.py")


def test_the_checker_catches_an_upward_import(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "layout.py"
    bad.write_text("from kvoffload.worker import Worker\n")
    with pytest.raises(AssertionError, match="imports worker"):
        test_module_imports_only_lower_layers(bad)


def test_the_manager_is_usable_without_importing_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvoffload\n"
        "from kvoffload import Manager, StorePlan, KVOffloadError\n"
        "m = Manager.create(4, fingerprint=b'f')\n"
        "assert m.lookup([b'k']) == 0\n"
        "bad = [n for n in ('torch', 'cuda', 'numpy') if n in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_public_name_resolves() -> None:
    import kvoffload

    for name in kvoffload.__all__:
        assert getattr(kvoffload, name) is not None, name


#: What integration modules may import from kvoffload: the public surface, each other, and
#: kvoffload.disk for DiskConfig (until it is public as kvoffload.DiskConfig).
INTEGRATION_IMPORTS = {"kvoffload", "kvoffload.testing", "kvoffload.integrations", "kvoffload.disk"}


def integration_modules() -> list[pathlib.Path]:
    return sorted((PACKAGE / "integrations").glob("*.py"))


@pytest.mark.parametrize("path", integration_modules(), ids=lambda p: p.stem)
def test_integrations_use_only_the_public_surface(path: pathlib.Path) -> None:
    for module in imported_modules(path):
        if module == "kvoffload" or module.startswith("kvoffload."):
            assert module in INTEGRATION_IMPORTS or module.startswith("kvoffload.integrations."), (
                f"integrations/{path.name} imports {module}: use the public names of kvoffload"
            )


def test_the_core_never_imports_an_integration() -> None:
    for path in package_modules():
        if path.stem == "__main__":
            continue  # the CLI imports an integration's demo inside its command, when it is run
        assert not any(m.startswith("kvoffload.integrations") for m in imported_modules(path)), path.stem
