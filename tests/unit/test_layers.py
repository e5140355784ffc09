"""The layers of keytrace/, checked over whole folders (every module, nested imports too).

docs/architecture.md ("Layers") states the rules; this file checks them, and the two change
together. A new module is covered the moment it is created.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "keytrace"
LAYERS = ("format", "judge", "record", "analysis", "live", "report", "vllm", "cli")
HOST = ("vllm", "torch")

# layer -> keytrace layers it must not import
FORBIDDEN_LAYERS = {
    "format": {"judge", "record", "analysis", "live", "report", "vllm", "cli"},
    "judge": {"record", "analysis", "live", "report", "vllm", "cli"},
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
    "judge": {*HOST, "click"},  # polars only inside functions, for an expression (ops)
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


# ----------------------------------------------------------------- keytrace/vllm by job
VLLM_JOBS = {
    # job -> keytrace.vllm subpackages it must not import (at any depth)
    "hook": {"lab"},  # runs inside a server: never the CPU lab
    "mods": {"hook", "lab"},  # applied through the hook's table; imports neither
    "lab": set(),
}


def _vllm_job_violations(job: str, source: str) -> list[str]:
    return [
        f"imports {m}"
        for m in imports(source)
        if any(m.startswith(f"keytrace.vllm.{other}") for other in VLLM_JOBS[job])
    ]


@pytest.mark.parametrize("job", sorted(VLLM_JOBS))
def test_the_vllm_layer_is_split_by_job(job: str) -> None:
    found = sorted((PKG / "vllm" / job).rglob("*.py"))
    assert found, f"keytrace/vllm/{job}/ holds no module"
    bad = {
        str(p.relative_to(PKG.parent)): v
        for p in found
        if (v := _vllm_job_violations(job, p.read_text()))
    }
    assert bad == {}
    top = {p.name for p in (PKG / "vllm").glob("*.py")}
    assert top == {"__init__.py"}, "every vLLM module belongs to hook/, mods/ or lab/"


def test_the_catalog_of_modifications_imports_nothing_that_applies_them() -> None:
    mods = imports((PKG / "vllm" / "mods" / "catalog.py").read_text())
    assert {m for m in mods if m.split(".")[0] in ("vllm", "torch", "wrapt")} == set()
    assert {m for m in mods if m.startswith("keytrace.")} <= {
        "keytrace.errors",
        "keytrace.errors.UsageError",
    }


def module_level_imports(source: str) -> set[str]:
    """The modules imported when a module is loaded (not inside functions)."""
    out: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_the_cli_loads_only_the_catalog_of_the_vllm_layer() -> None:
    bad = {}
    for p in modules("cli"):
        mods = module_level_imports(p.read_text())
        # plus what the option helpers import while the command's options are built
        if p.name == "_common.py":
            mods |= imports(p.read_text())
        wrong = {
            m
            for m in mods
            if m.startswith("keytrace.vllm") and not m.startswith("keytrace.vllm.mods.catalog")
        }
        if wrong:
            bad[p.name] = sorted(wrong)
    assert bad == {}


# --------------------------------------------------------------------- import circles
def _module_name(p: Path) -> str:
    parts = p.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """keytrace module -> the keytrace modules it imports, at any depth (a function-level
    import closes a circle as surely as a top-level one: it only delays it)."""
    names = {_module_name(p) for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for p in PKG.rglob("*.py"):
        me = _module_name(p)
        out = set()
        for target in imports(p.read_text()):
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != me and not me.startswith(target + "."):
                out.add(target)
        graph[me] = out
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_the_circle_finder_can_fail() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# ------------------------------------------------------------ constructors never patch
PATCHING = {
    "enable",
    "install",
    "apply_fix",
    "apply_injection",
    "fix_from_env",
    "inject_from_env",
    "fixed",
    "injected",
    "recording",
}
"""What switches a modification or recording on for the whole process (keytrace.vllm.hook
.patches): only entry points (a command, `replay`, the plugin) may call these; building an
object must leave vLLM as it was (a harness built in a test must not inject a bug)."""


def _called(fn: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
    return out


def constructor_patches(source: str) -> list[str]:
    """Per class: whether ``__init__``, or a method of the class it calls (transitively),
    calls one of `PATCHING`."""
    bad = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        todo, seen = ["__init__"], set()
        while todo:
            name = todo.pop()
            if name in seen or name not in methods:
                continue
            seen.add(name)
            calls = _called(methods[name])
            if calls & PATCHING:
                bad.append(f"{cls.name}.{name} calls {', '.join(sorted(calls & PATCHING))}")
            todo.extend(calls & set(methods))
    return bad


def test_constructors_never_patch() -> None:
    bad = {
        str(p.relative_to(PKG.parent)): v
        for p in sorted(PKG.rglob("*.py"))
        if (v := constructor_patches(p.read_text()))
    }
    assert bad == {}


def test_the_constructor_check_can_fail() -> None:
    planted = (
        "class H:\n    def __init__(self):\n        self._setup()\n"
        "    def _setup(self):\n        patches.inject_from_env()\n"
    )
    assert constructor_patches(planted) == ["H._setup calls inject_from_env"]
