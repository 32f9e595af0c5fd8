"""Structure rules of the tree, checked on the source text (``ast``), no imports:

* no import circle among the modules of ``src/liger_kernel`` or of ``benchmarks`` (function-level
  imports included: a circle closed by a lazy import is still a circle a reader has to untangle);
* the layers import downwards only: ``ops`` and ``reference`` nothing of the other layers,
  ``chunked_loss`` nothing of ``transformers``, ``hub`` nothing but ``ops``;
* no function in ``src/`` longer than :data:`MAX_FUNCTION_LINES`, except the Triton kernels named
  in :data:`LONG_KERNELS` with the reason each one stays whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80

# @triton.jit kernels allowed past the limit, each with why splitting it would not make it clearer.
LONG_KERNELS: dict[str, str] = {}


def _module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir`` (a package's name is its
    ``__init__``)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its file. ``from pkg import x``
    counts as importing ``pkg.x`` when that is a module, else ``pkg``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = _module_files(package_dir)
    return {name: _imported_modules(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_cycle_finder_finds_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["src/liger_kernel", "benchmarks"])
def test_no_import_cycles(package):
    cycles = import_cycles(import_graph(ROOT / package))
    assert not cycles, f"import circles in {package}: {cycles}"


# Layer -> the layers it must not import.
FORBIDDEN_IMPORTS = {
    "liger_kernel.ops": ("liger_kernel.transformers", "liger_kernel.chunked_loss", "liger_kernel.hub"),
    "liger_kernel.reference": ("liger_kernel.transformers", "liger_kernel.chunked_loss", "liger_kernel.ops"),
    "liger_kernel.chunked_loss": ("liger_kernel.transformers", "liger_kernel.hub"),
    # The Hub-kernel build bundles the layers with liger_kernel.ops only.
    "liger_kernel.hub": ("liger_kernel.transformers", "liger_kernel.chunked_loss", "liger_kernel.reference"),
}


def test_layers_import_downwards():
    graph = import_graph(ROOT / "src/liger_kernel")
    upward = sorted(
        f"{module} -> {imported}"
        for module, imports in graph.items()
        for layer, forbidden in FORBIDDEN_IMPORTS.items() if module == layer or module.startswith(layer + ".")
        for imported in imports if imported.startswith(forbidden)
    )
    assert not upward, f"imports against the layering (transformers -> ops, never back): {upward}"


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def long_functions(src: Path) -> dict[str, tuple[int, bool]]:
    """``path::name`` -> (lines with decorators, whether it is a Triton kernel) of every function
    longer than the limit."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{path.relative_to(src).as_posix()}::{node.name}"] = (lines, _is_triton_kernel(node))
    return found


def test_no_long_functions():
    found = long_functions(ROOT / "src/liger_kernel")
    too_long = {name: lines for name, (lines, _) in found.items() if name not in LONG_KERNELS}
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {too_long}"
    not_kernels = [name for name in LONG_KERNELS if name in found and not found[name][1]]
    assert not not_kernels, f"only @triton.jit kernels may be allowed past the limit: {not_kernels}"
    stale = sorted(set(LONG_KERNELS) - set(found))
    assert not stale, f"allowed but no longer long (remove from LONG_KERNELS): {stale}"
