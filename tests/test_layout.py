"""The package's shape: no module of vlens imports itself back through others — counting every import, in
functions and under `if TYPE_CHECKING:` too, and the package `__init__` an import of a submodule runs — and
one position parser serves every entry point, and importing vlens leaves the compiler out.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vlens"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """vlens modules this file imports anywhere: `from a import b` names the module a.b where there is one,
    else a; importing a.b.c runs the `__init__` of a.b too (the root package `vlens` aside)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlens"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vlens"))
    packages = {".".join(name.split(".")[:k]) for name in found for k in range(2, name.count(".") + 1)}
    return found | (packages & modules)


def test_no_import_cycles():
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {name: {m for m in _imports(path, set(modules)) if m != name and not name.startswith(m + ".")}
             for name, path in modules.items()}  # fmt: skip
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_one_position_parser():
    """Position specs are parsed in one place: nothing else compares against the keywords."""
    pattern = re.compile(r"""in \("all", "prompt", "generated", "last"\)|POSITION_KEYWORDS|parse_positions""")
    hits = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if pattern.search(p.read_text())]
    assert hits == [], hits


def test_import_leaves_the_compiler_out():
    """Importing vlens (its CLI, server and harvest too) does not import torch._dynamo (1.4 s of every process's
    start: the CLI, each tensor-parallel rank, each Ray actor) nor Triton; a compile or the flex backend brings them
    in when used."""
    code = "import sys, vlens, vlens.cli, vlens.server.app, vlens.harvest.job; print(*sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert not {"torch._dynamo", "triton"} & set(loaded)
