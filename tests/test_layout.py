"""The package's rooms hold: the daemon never loads torch, transformers or CUDA, only
``skippyd.cluster.coordination`` imports ``redis``, the daemon side never imports the client side or an
engine, and the client side's old import names give the same module objects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "skippyd"

#: Modules only an engine's process (or a tool run there) loads: everything else is the daemon's side.
CLIENT_SIDE = ("client", "integrations")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute, at any depth of its code (lazy imports count)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # (from x import submodule)
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_native" not in p.parts)


def _is_client_side(module: str) -> bool:
    parts = module.split(".")
    return (len(parts) > 1 and parts[1] in CLIENT_SIDE) or module in ("skippyd.blockspace", "skippyd.tensors")


def test_only_the_coordination_module_imports_redis() -> None:
    importers = {
        _module_name(path)
        for path in _sources()
        if any(m == "redis" or m.startswith("redis.") for m in _imports(path))
    }
    assert importers == {"skippyd.cluster.coordination"}


@pytest.mark.parametrize("engine", ["torch", "transformers", "vllm", "sglang", "cuda"])
def test_the_daemon_side_imports_no_engine_torch_or_cuda_anywhere_in_its_code(engine: str) -> None:
    """Lazy imports inside functions count too: the daemon's process must never reach one."""
    offenders = {
        _module_name(path): sorted(m for m in _imports(path) if m == engine or m.startswith(engine + "."))
        for path in _sources()
        if not _is_client_side(_module_name(path))
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_daemon_side_never_imports_the_client_side() -> None:
    """The arrows point from the client to the wire, never from the daemon to the client (the CLI's
    client commands are the one exception: a tool the operator runs, not the daemon's process)."""
    allowed = {"skippyd", "skippyd.cli", "skippyd.doctor"}  # lazy re-exports; the CLI's client commands
    offenders = {}
    for path in _sources():
        name = _module_name(path)
        if _is_client_side(name) or name in allowed:
            continue
        reached = sorted(m for m in _imports(path) if m.startswith("skippyd.") and _is_client_side(m))
        if reached:
            offenders[name] = reached
    assert offenders == {}


def test_starting_the_daemon_loads_no_torch_transformers_or_redis_client_side_modules() -> None:
    """Importing everything the daemon's process runs (``skippyd serve``'s path) loads no torch, no
    transformers and nothing of ``skippyd.client``; importing the client package loads no torch either
    (tensors and the device transfer load it on first use)."""
    code = (
        "import sys, skippyd, skippyd.cli, skippyd.daemon, skippyd.server, skippyd.handlers, skippyd.doctor\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')"
        " or m.startswith('skippyd.client') or m.startswith('skippyd.integrations'))\n"
        "print(bad)\n"
        "import skippyd.client, skippyd.client.transfer\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    daemon_side, client_side = out.stdout.splitlines()
    assert daemon_side == "[]"
    assert client_side == "[]"


def test_the_old_client_module_names_are_the_moved_modules_themselves() -> None:
    import skippyd.blockspace
    import skippyd.client.blockspace
    import skippyd.client.tensors
    import skippyd.tensors

    assert skippyd.blockspace is skippyd.client.blockspace
    assert skippyd.tensors is skippyd.client.tensors
    from skippyd.blockspace import BlockSpace

    assert BlockSpace is skippyd.BlockSpace


def test_every_package_folder_says_what_it_holds() -> None:
    """Each folder of the package is a room with a docstring naming what it owns."""
    for init in PACKAGE.rglob("__init__.py"):
        if "_native" in init.parts:
            continue
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init.relative_to(PACKAGE.parent)} has no docstring"
