"""The layers of docs/design.md §3, as folders and modules, depend downward only; only the bindings
import cuda-python; the scheduler side imports no torch; the tools use the public API only.

``LAYERS`` states the design: every module of the package has a layer (a module the table does not
know fails the test), and a module may import only modules of a lower layer. Imports made for
annotations only (under ``TYPE_CHECKING``) count too, except for the torch check.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kvoffload"

#: The design's layers, lowest first: a module may import only modules of a lower layer.
LAYERS: dict[str, int] = {
    # records and errors every layer shares
    "errors": 0,
    "records": 0,
    # pure helpers, the bindings, the scheduler side's own layers, the disk tier's configuration
    "_validate": 1,
    "_seconds": 1,
    "_memory": 1,
    "_descriptors": 1,
    "_layer_map": 1,
    "_layer_load": 2,
    "bindings.types": 0,
    "bindings.__init__": 1,
    "bindings.driver": 1,
    "bindings.pinning": 1,
    "native.__init__": 1,
    "manager.__init__": 1,
    "manager.policies": 1,
    "manager.records": 1,
    "disk.__init__": 1,
    "disk.config": 1,
    "_jobs": 2,
    "bindings.copier": 2,
    "bindings.kernel": 2,
    "manager.state": 2,
    "manager.remote": 3,
    "manager.base": 4,
    "disk.format": 2,
    "pool.header": 1,
    "pool.view": 2,
    "pool.spec": 3,
    "pool.session": 4,
    "pool.__init__": 4,
    "layout": 3,
    "region": 5,
    "calibration": 3,
    "_layer_groups": 3,
    "manager.manager": 5,
    "disk.index": 3,
    "disk.requests": 3,
    "backends.__init__": 3,
    "backends.host": 3,
    "backends.cuda": 3,
    "handler": 4,
    "backends.kernel": 4,
    "backends.native": 5,
    "disk.stages": 4,
    "disk.tier": 5,
    # composition: the only place that knows how the layers fit together
    "worker.__init__": 6,
    "worker.booking": 6,
    "worker.pipeline": 6,
    "worker.teardown": 6,
    "worker.assembly": 7,
    "worker.worker": 8,
    # the public surface, then what is built on it
    "__init__": 9,
    "testing.fake": 2,
    "testing.hold": 2,
    "testing.services": 5,
    "testing.memory_store": 4,
    "testing.__init__": 9,
    "cli._caches": 10,
    "cli._args": 10,
    "cli._torch": 10,
    "cli._replay_model": 11,
    "cli._replay_engine": 12,
    "cli._replay_remote": 12,
    "cli.demo": 11,
    "cli.manager_bench": 11,
    "cli.disk_bench": 11,
    "cli.latency_bench": 11,
    "cli.ranks_bench": 11,
    "cli.remote_bench": 11,
    "cli.bench": 12,
    "cli.replay": 13,
    "cli.__init__": 14,
    "__main__": 15,
    # the remote tier (an optional extra)
    "_record": 1,
    "remote._types": 1,
    "remote._args": 2,
    "remote._lane": 2,
    "remote._base": 3,
    "remote.mooncake": 4,
    "remote.redis_cluster": 4,
    "remote.config": 5,
    "remote.tier": 6,
    "remote.__init__": 6,
    # engine adapters, optional extras on the public surface
    "integrations.__init__": 10,
    "integrations.vllm_support": 10,
    "integrations._vllm_policy": 10,
    "integrations._vllm_worker": 11,
    "integrations.vllm": 12,
    "integrations._transformers_surface": 10,
    "integrations._transformers_session": 11,
    "integrations.transformers": 12,
    "integrations.transformers_demo": 13,
}
CUDA_PACKAGES = ("bindings.",)
#: Modules that must not import torch at run time (the scheduler side and what it stands on).
TORCH_FREE = {
    "errors", "records", "_validate", "_seconds", "_memory", "_jobs", "_layer_map", "_layer_load", "bindings.types", "bindings.driver", "bindings.pinning",
    "native.__init__",
    "bindings.copier", "bindings.kernel", "disk.config", "manager.policies", "manager.records",
    "manager.state", "manager.remote", "manager.base", "manager.manager", "worker.booking",
    "integrations._vllm_policy",
}


def module_name(path: pathlib.Path) -> str:
    """``kvoffload/disk/tier.py`` -> ``disk.tier``."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imported for annotations only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def imported_modules(path: pathlib.Path, *, runtime_only: bool = False) -> set[str]:
    """Modules ``path`` imports (``kvoffload.x`` named ``kvoffload.x``; a name taken from the
    package itself, ``from kvoffload import Worker``, named ``kvoffload``); with ``runtime_only``,
    not those imported for annotations only."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_only(tree) if runtime_only else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.level:
                raise AssertionError(f"{path.name} uses a relative import; use kvoffload.<module>")
            if not node.module.startswith("kvoffload"):
                found.add(node.module)
                continue
            where = PACKAGE.joinpath(*node.module.split(".")[1:])
            for alias in node.names:  # a submodule, or a name from the package's __init__
                is_module = (where / f"{alias.name}.py").exists() or (where / alias.name).is_dir()
                found.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return found


def layer_of(module: str) -> str:
    """The ``LAYERS`` key of an imported ``kvoffload...`` module (a package is its ``__init__``)."""
    name = module[len("kvoffload."):] if module != "kvoffload" else "__init__"
    if (PACKAGE / name.replace(".", "/")).is_dir():
        name += ".__init__"
    return name


def package_modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    names = {module_name(p) for p in package_modules()}
    assert names <= set(LAYERS), f"give these modules a layer: {sorted(names - set(LAYERS))}"
    assert not set(LAYERS) - names, f"these layers name no module: {sorted(set(LAYERS) - names)}"


@pytest.mark.parametrize("path", package_modules(), ids=module_name)
def test_module_imports_only_lower_layers(path: pathlib.Path, me: str | None = None) -> None:
    me = me or module_name(path)
    for module in imported_modules(path):
        if not module.startswith("kvoffload.") and module != "kvoffload":
            continue
        target = layer_of(module)
        assert target in LAYERS, f"{me} imports {module}, which has no layer"
        assert LAYERS[target] < LAYERS[me], (
            f"{me} (layer {LAYERS[me]}) imports {target} (layer {LAYERS[target]})"
        )


@pytest.mark.parametrize("path", package_modules(), ids=module_name)
def test_only_the_bindings_import_cuda_python(path: pathlib.Path) -> None:
    name = module_name(path)
    uses_cuda = any(m == "cuda" or m.startswith("cuda.") for m in imported_modules(path))
    assert not uses_cuda or name.startswith(CUDA_PACKAGES), f"{name} imports cuda-python"


@pytest.mark.parametrize("name", sorted(TORCH_FREE))
def test_the_scheduler_side_and_the_lowest_layers_do_not_import_torch(name: str) -> None:
    modules = imported_modules(PACKAGE / (name.replace(".", "/") + ".py"), runtime_only=True)
    assert not any(m == "torch" or m.startswith("torch.") for m in modules)


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "cli").glob("*.py")) + sorted((PACKAGE / "integrations").glob("*.py")),
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)
def test_the_tools_use_the_public_api_only(path: pathlib.Path) -> None:
    own = f"kvoffload.{path.parent.name}"
    allowed = ("kvoffload", "kvoffload.testing")
    for module in imported_modules(path):
        if module.startswith("kvoffload"):
            adapter = path.parent.name == "cli" and module.startswith("kvoffload.integrations")
            # the engine demo is a command too: it checks its flags with the tools' helpers
            flags = path.name == "transformers_demo.py" and module == "kvoffload.cli._args"
            assert module in allowed or module.startswith(own) or adapter or flags, (
                f"{path.parent.name}/{path.name} imports {module}: the tools use only names from "
                "kvoffload"
            )


def test_the_core_never_imports_an_integration() -> None:
    for path in package_modules():
        if "integrations" in path.parts or "cli" in path.parts or path.name == "__main__.py":
            continue  # the tools and the command table may run an adapter
        assert not any(m.startswith("kvoffload.integrations") for m in imported_modules(path)), path


def test_region_and_handler_are_siblings() -> None:
    assert "kvoffload.handler" not in imported_modules(PACKAGE / "region.py")
    assert "kvoffload.region" not in imported_modules(PACKAGE / "handler.py")


def test_the_backends_fill_the_handlers_seam_without_importing_it() -> None:
    for path in (PACKAGE / "backends").glob("*.py"):
        assert "kvoffload.handler" not in imported_modules(path), path.name


def test_the_checker_catches_an_upward_import(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "layout.py"
    bad.write_text("from kvoffload.worker.worker import Worker\n")
    with pytest.raises(AssertionError, match="imports worker.worker"):
        test_module_imports_only_lower_layers(bad, "layout")


def test_the_checker_catches_a_module_with_no_layer(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "layout.py"
    bad.write_text("from kvoffload.nowhere import thing\n")
    with pytest.raises(AssertionError, match="which has no layer"):
        test_module_imports_only_lower_layers(bad, "layout")


def test_the_checker_catches_a_tool_importing_a_private_name(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "tool.py"
    bad.write_text("from kvoffload.worker.worker import Worker\n")
    with pytest.raises(AssertionError, match="the tools use only names from kvoffload"):
        test_the_tools_use_the_public_api_only(bad)


def test_the_manager_is_usable_without_importing_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvoffload\n"
        "from kvoffload import Manager, StorePlan, KVOffloadError, DiskConfig\n"
        "m = Manager.create(4, fingerprint=b'f')\n"
        "assert m.lookup([b'k']) == 0\n"
        "bad = [n for n in ('torch', 'cuda', 'numpy') if n in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_a_host_worker_runs_without_cuda_python() -> None:
    """The CPU path never imports cuda-python: it runs where cuda-bindings is not installed."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cuda' or name.startswith('cuda.'):\n"
        "            raise ImportError('cuda-python is not installed')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, kvoffload\n"
        "t = {'kv': torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16)}\n"
        "layout = kvoffload.DeviceLayout.from_tensors(t, 1, num_blocks=8)\n"
        "with kvoffload.Worker.create(layout, 4) as w:\n"
        "    w.store(1, [0], [0])\n"
        "    assert w.wait([1], 30.0)[0].ok\n"
        "assert not any(n == 'cuda' or n.startswith('cuda.') for n in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_a_cuda_worker_without_cuda_python_names_the_extra_to_install() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cuda' or name.startswith('cuda.'):\n"
        "            raise ImportError('No module named cuda')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, kvoffload\n"
        "from kvoffload.worker.assembly import _cuda_parts\n"
        "layout = kvoffload.DeviceLayout.from_tensors({'kv': torch.zeros(2, 8, 64)}, 1)\n"
        "try:\n"
        "    _cuda_parts(layout, None)\n"
        "except kvoffload.MissingDependencyError as exc:\n"
        "    assert \"kvoffload[cuda]\" in str(exc) and isinstance(exc, ImportError), exc\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_public_name_resolves() -> None:
    import kvoffload

    for name in kvoffload.__all__:
        assert getattr(kvoffload, name) is not None, name
