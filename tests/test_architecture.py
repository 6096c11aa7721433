"""The package's shape: imports go one way, down the layers below, with no circle; no module over
600 lines; the whole package at most 10,000 lines of code. The layer order is defined here and nowhere else (docs/architecture.md explains it).

Every import counts, function-level ones too: a circle closed inside a function is still one.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "exactdit"

#: lowest first; a module may import its own layer and the layers below it, never one above
LAYERS = (
    ("aten", ("exactdit.aten", "exactdit.state", "exactdit.first_calls")),
    ("device", ("exactdit.device",)),
    ("gate", ("exactdit.gate",)),
    ("engine", ("exactdit.engine",)),
    ("patches", ("exactdit.patches", "exactdit.parallel")),
    ("top", ("exactdit.report", "exactdit.harness", "exactdit.cli", "exactdit.__main__", "exactdit")),
)
MAX_LINES = 600
#: lines of code in the whole package: not blank, not a comment, not a docstring (cloc's count)
MAX_CODE_LINES = 10_000


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The exactdit module ``name`` names (a module, or the longest module prefix of it)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("exactdit") else None
            if target and target != module:
                found.add(target)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def layer_of(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in GRAPH.items() for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert not _cycles(), _cycles()


def test_no_private_name_imported_from_another_layer():
    """A ``_name`` is its module's own: another layer may not import it."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("exactdit") and not node.level:
                target = _resolve(node.module)
                for a in node.names:
                    if a.name.startswith("_") and target and layer_of(target) != layer_of(module):
                        found.append(f"{module} imports {node.module}.{a.name}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_the_line_limit(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module]}: {lines} lines (at most {MAX_LINES})"


def code_lines(source: str) -> int:
    """Lines that are not blank, not a comment and not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docstrings)


def test_the_package_is_at_most_ten_thousand_lines_of_code():
    assert code_lines('"""doc\nstring"""\n\n# why\nx = 1  # one\n') == 1
    total = sum(code_lines(path.read_text()) for path in MODULES.values())
    assert total <= MAX_CODE_LINES, f"{total} lines of code in exactdit/ (at most {MAX_CODE_LINES})"


def test_the_checks_see_a_circle_and_an_upward_import():
    """The graph is read as meant: the gate is below the engine, the engine imports the gate."""
    assert layer_of("exactdit.gate") < layer_of("exactdit.engine.runtime")
    assert "exactdit.gate" in GRAPH["exactdit.engine.runtime"]
