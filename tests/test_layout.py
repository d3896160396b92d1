"""The package's shape: no module of vlens imports itself back through others (imports made only for type
checking do not count: they never run), and one position parser serves every entry point."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vlens"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """vlens modules this file imports when it runs (not under `if TYPE_CHECKING:`): `from a import b`
    names the module a.b where there is one, else a."""
    tree = ast.parse(path.read_text())
    skip = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlens"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vlens"))
    return found


def test_no_import_cycles():
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {name: _runtime_imports(path, set(modules)) - {name} for name, path in modules.items()}
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
