"""No import cycles anywhere in `src/specaudit`: two modules that import each other cannot be
read, tested or changed one at a time, and a cycle only works by the accident of which module
Python happens to load first.

The graph is read from the source with `ast`, not by importing: every `import a.b` and
`from x import y` (absolute or relative, `from . import x` included), at module level and inside
functions (a deferred import is still a dependency; deferring it only hides the cycle from the
interpreter). `from pkg import name` is an edge to the module `pkg.name` when that is a module,
else to `pkg` itself.

Imports under `if TYPE_CHECKING:` do not count: they never run, so they set no load order, and
they are the sanctioned way to name, in an annotation, a type owned by the module that calls
this one (a registry's factory typed with the request that the registry builds). The `else:`
branch of such an `if` does run, and counts.

Not counted: the implicit import of a package's `__init__` when one of its submodules is
imported. A package that re-exports its submodules would otherwise form a cycle with every one
of them, and Python handles that order by design.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "specaudit"


def modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its `__init__`)."""
    found: dict[str, Path] = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module `name` denotes, or the longest enclosing one that exists; None if external."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(node: ast.AST) -> list[ast.AST]:
    """Every node under `node`, leaving out the bodies of `if TYPE_CHECKING:` blocks."""
    found: list[ast.AST] = []
    todo = [node]
    while todo:
        n = todo.pop()
        found.append(n)
        if isinstance(n, ast.If) and _type_checking_only(n):
            todo.extend(n.orelse)
            continue
        todo.extend(ast.iter_child_nodes(n))
    return found


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of the package that `module` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # relative: `.` is the module's own package (itself if it is a package)
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                targets.append(sub if sub in known else origin)
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module:
                out.add(resolved)
    return out


def graph(src: Path = SRC) -> dict[str, set[str]]:
    known = modules(src)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_reader_sees_every_import_form(tmp_path: Path) -> None:
    """The checker itself: each import form yields its edge, and a circle is reported."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f() -> None:\n    from specaudit.sub import c\n",
        "sub/__init__.py": (
            "import typing\nif typing.TYPE_CHECKING:\n    from specaudit import a\n"
            "else:\n    import specaudit.sub.e\n"
        ),
        "sub/c.py": "import specaudit.sub.d\n",
        "sub/d.py": "from ..a import thing\n",
        "sub/e.py": (
            "from typing import TYPE_CHECKING\nfrom .c import x\nimport specaudit\n"
            "if TYPE_CHECKING:\n    from specaudit.b import f\n"
        ),
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges = graph(tmp_path)
    assert edges["specaudit.a"] == {"specaudit.b"}
    assert edges["specaudit.b"] == {"specaudit.sub.c"}
    assert edges["specaudit.sub.c"] == {"specaudit.sub.d"}
    assert edges["specaudit.sub.d"] == {"specaudit.a"}
    assert edges["specaudit.sub.e"] == {"specaudit.sub.c", "specaudit"}
    assert edges["specaudit.sub"] == {"specaudit.sub.e"}
    assert cycles(edges) == [["specaudit.a", "specaudit.b", "specaudit.sub.c", "specaudit.sub.d"]]


def test_no_import_cycles_in_src() -> None:
    edges = graph()
    assert len(edges) > 50, "too few modules found: the test is looking in the wrong place"
    assert cycles(edges) == []


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in edges.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _under(names: set[str], *packages: str) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in packages))


def test_the_shared_reference_client_depends_on_neither_command_that_uses_it() -> None:
    """`specaudit.reference` (a plain llama-server as the reference) serves `check --reference`
    and `rescore` alike: both import it, it imports neither, and neither command loads the
    other through it."""
    edges = graph()
    assert "specaudit.reference" in edges["specaudit.check.with_reference"]
    assert "specaudit.reference" in edges["specaudit.rescore.runner"]
    reach = reachable(edges, "specaudit.reference")
    assert _under(reach, "specaudit.check", "specaudit.rescore") == []
    assert _under(reachable(edges, "specaudit.check"), "specaudit.rescore") == []
    assert _under(reachable(edges, "specaudit.rescore"), "specaudit.check") == []
