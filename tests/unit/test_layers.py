"""The layers of keytrace/, checked over whole folders (every module, nested imports too).

Imports point down: format -> record -> analysis -> live -> report -> vllm -> cli. Nothing but
``keytrace/vllm/`` imports vLLM or torch; analysis returns data and never prints; nothing
in the package imports ``tools/``. A new module is covered the moment it is created.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "keytrace"
LAYERS = ("format", "record", "analysis", "live", "report", "vllm", "cli")
HOST = ("vllm", "torch")

# layer -> keytrace layers it must not import
FORBIDDEN_LAYERS = {
    "format": {"record", "analysis", "live", "report", "vllm", "cli"},
    "record": {"analysis", "live", "report", "vllm", "cli"},
    "analysis": {"record", "live", "report", "vllm", "cli"},
    "live": {"report", "vllm", "cli"},
    "report": {"record", "live", "vllm", "cli"},
    "vllm": {"cli"},
    "cli": set(),
}
# layer -> third-party packages it must not import
FORBIDDEN_PACKAGES = {
    "format": {*HOST, "click"},
    "record": {*HOST, "polars", "click"},
    "analysis": {*HOST, "click"},
    "live": {*HOST, "polars", "click"},  # runs in every serving process
    "report": {*HOST, "click"},
    "vllm": {"click"},
    "cli": set(),  # imports the vllm layer lazily inside commands
}


def imports(source: str) -> set[str]:
    """Every module an AST imports, at any depth (functions included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def prints(source: str) -> list[str]:
    """Ways a module writes to the terminal: print(), sys.stdout/stderr, click."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "print"
        ):
            found.append(f"print() at line {node.lineno}")
        if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr"):
            found.append(f"sys.{node.attr} at line {node.lineno}")
    return found


def violations(layer: str, source: str) -> list[str]:
    bad = []
    for mod in imports(source):
        parts = mod.split(".")
        if parts[0] == "keytrace" and len(parts) > 1 and parts[1] in FORBIDDEN_LAYERS[layer]:
            bad.append(f"imports {mod}")
        if parts[0] in FORBIDDEN_PACKAGES[layer]:
            bad.append(f"imports {mod}")
        if parts[0] == "tools":
            bad.append(f"imports {mod} (tools/ is not part of the package)")
    if layer == "analysis":
        bad += prints(source)
    return bad


def modules(layer: str) -> list[Path]:
    return sorted((PKG / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_point_down(layer: str) -> None:
    found = modules(layer)
    assert found, f"keytrace/{layer}/ holds no module"
    bad = {
        str(p.relative_to(PKG.parent)): v for p in found if (v := violations(layer, p.read_text()))
    }
    assert bad == {}


def test_every_module_is_in_a_layer() -> None:
    top = {p.name for p in PKG.glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "_version.py", "errors.py"}
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)


def test_base_modules_import_nothing_above() -> None:
    for name in ("__init__.py", "_version.py", "errors.py"):
        mods = imports((PKG / name).read_text())
        above = [
            m for m in mods if m.startswith("keytrace.") and not m.startswith("keytrace._version")
        ]
        assert above == [], name


def test_the_checker_can_fail() -> None:
    # nested imports are found, and each rule fires on a planted violation
    planted = "def f():\n    import vllm\n    from keytrace.report import text\n    print('x')\n"
    assert sorted(violations("analysis", planted)) == [
        "imports keytrace.report",
        "imports keytrace.report.text",
        "imports vllm",
        "print() at line 4",
    ]
    assert violations("record", "import polars\n") == ["imports polars"]
    assert violations("format", "from keytrace.analysis.diff import diff\n")
    assert violations("cli", "import tools.gen_trace\n") == [
        "imports tools.gen_trace (tools/ is not part of the package)"
    ]
    assert prints("import sys\nsys.stderr.write('x')\n") == ["sys.stderr at line 2"]
