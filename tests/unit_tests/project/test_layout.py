"""The project's own budgets (CONTRIBUTING.md): no import cycle between tierstack's modules (imports
inside functions included), layers import downwards only, and every module stays within 400 lines."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "tierstack"
# Lower number = lower layer; a module may import its own layer's modules or lower ones.
LAYERS = {"errors": 0, "train_state": 0, "config": 0, "runtime": 0,
          "checkpointing": 1, "data": 1, "models": 1, "observability": 1, "resiliency": 1, "hf": 3,
          "training": 3, "recipes": 4, "cli": 5, "__init__": 5}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, modules) -> set[str]:
    """tierstack modules ``path`` imports anywhere in its body, functions included: ``from X import y``
    counts ``X.y`` when that is a module, else ``X`` (a name taken from it)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tierstack")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tierstack") and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def _graph() -> dict[str, set[str]]:
    files = {(_module_name(p)): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # importing a package's submodule runs the package's __init__ too, which is part of the graph
        graph[name] = {m for m in _imports(path, files) if m in files and m != name}
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else LAYERS["__init__"]


def test_no_import_cycle():
    graph = _graph()
    state: dict = {}
    stack: list = []
    cycles = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_imports_go_downwards_only():
    upward = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps if _layer(d) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_modules_stay_within_the_line_budget():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
