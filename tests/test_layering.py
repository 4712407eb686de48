"""The package's layers (docs/architecture.md): cli / serve / bench / train -> decode -> model -> io / config,
and no import cycle anywhere inside src/mtp (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "mtp"

# layer of each top-level part: a module may import only from its own layer or lower ones
LAYERS = {"config": 0, "io": 0, "data": 0, "model": 1, "decode": 2, "train": 3, "bench": 3, "serve": 3,
          "cli_common": 3, "check": 3, "convert": 3, "quantize": 3, "cli": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The mtp modules `name` imports (relative imports resolved; `from pkg import sub` counts sub, not pkg)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            subs = [f"{root}.{a.name}" for a in node.names if f"{root}.{a.name}" in known]
            # `from pkg import sub` imports the submodule; the package itself only when a name is not a submodule
            targets = subs + ([root] if len(subs) < len(node.names) else [])
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def part(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers_only_import_downwards():
    bad = []
    for a, bs in graph().items():
        pa = part(a)
        if pa not in LAYERS:
            continue
        for b in bs:
            pb = part(b)
            if pb in LAYERS and pb != pa and LAYERS[pb] > LAYERS[pa]:
                bad.append(f"{a} imports {b}")
    assert not bad, "\n".join(bad)


def test_the_test_sees_a_cycle(tmp_path, monkeypatch):
    """The walker itself: a planted mutual import is found."""
    pkg = tmp_path / "mtp"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text("from .b import x\n")
    (pkg / "model" / "b.py").write_text("def f():\n    from . import a\n    from .. import model\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    g = graph()
    # `from . import a` imports the submodule only; `from .. import model` the package
    assert g["mtp.model.a"] == {"mtp.model.b"} and g["mtp.model.b"] == {"mtp.model", "mtp.model.a"}
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "mtp.model.a -> mtp.model.b -> mtp.model.a" in str(e)
    else:
        raise AssertionError("the planted cycle was not found")
