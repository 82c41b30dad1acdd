"""Import hygiene: the server loads no tools module, imports no engine internal, and no project
modules (engine/, server/) import each other in a cycle, function-local imports included."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "bench", "builder", "specexec")
ENGINE_INTERNALS = ("engine.speculation", "engine.model", "engine.offload")
PROGRAMS = ("bench", "builder", "specexec")  # programs that use the engine and the server
HEAVY_TOOL_MODULES = ("matplotlib", "tqdm")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def imported_modules(path: Path, module: str, modules: Collection[str]) -> set[str]:
    """The project modules named by import statements anywhere in the file (function-local ones
    included); `from pkg import name` names `pkg.name` when that is a module, else `pkg`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return (found & set(modules)) - {module}


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    modules = project_modules()
    return {module: imported_modules(path, module, modules) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with an explicit path)."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path: list[str] = [root]
        on_path = {root}
        stack = [iter(sorted(graph[root]))]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif child in on_path:
                return path[path.index(child):] + [child]
            elif child not in done:
                path.append(child)
                on_path.add(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_import_graph_sees_local_and_relative_imports() -> None:
    graph = import_graph()
    assert "engine.types" in graph["engine.async_engine"]
    assert "engine.runtime" in graph["server.state"]  # imported inside default_loader
    assert "server.app" in graph["server.serve"]  # imported inside run_server


def test_no_import_cycles_between_project_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_server_imports_no_engine_internal() -> None:
    graph = import_graph()
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith("server")
        for target in targets
        if target.startswith(ENGINE_INTERNALS)
    )
    assert not bad, bad


def test_importing_the_app_loads_no_tools_module() -> None:
    code = (
        "import sys, server.app\n"
        f"prefixes = {(*PROGRAMS, *HEAVY_TOOL_MODULES)!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in prefixes or m.startswith(prefixes)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_engine_and_server_import_no_program() -> None:
    graph = import_graph()
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith(("engine", "server"))
        for target in targets
        if target.startswith(PROGRAMS)
    )
    assert not bad, bad


def test_help_imports_no_torch() -> None:
    code = (
        "import sys\nfrom specexec.__main__ import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'], ['serve', '--no-such-flag']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr
