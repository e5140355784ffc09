"""The judge's signatures say what they return: no ``Any``, and the kind given comes back.

Each rule is called with plain values by the live alarm and with polars expressions by the
differ. Its overloads tell mypy which (``int`` in, ``int`` out; an expression in, an
expression out), so a caller that treats a plain result as a column, or the reverse, is a
type error; ``tests/typing/judge_kinds.py`` pins what mypy must infer.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JUDGE = ROOT / "keytrace" / "judge"
JSON_DOCUMENTS = ("dict[str, Any]", "Mapping[str, Any]")
"""A trace header or a tier's description: a JSON document, the one ``Any`` a rule may
take (``rules.groups_from_header`` and the like read it into typed values)."""


def _annotations(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    every += [a for a in (args.vararg, args.kwarg) if a is not None]
    out = [ast.unparse(a.annotation) for a in every if a.annotation is not None]
    if fn.returns is not None:
        out.append(ast.unparse(fn.returns))
    return out


def _uses_any(annotation: str) -> bool:
    for allowed in JSON_DOCUMENTS:
        annotation = annotation.replace(allowed, "")
    return re.search(r"\bAny\b", annotation) is not None


@pytest.mark.parametrize("module", ["definitions.py", "ops.py", "rules.py"])
def test_no_any_in_the_public_signatures(module: str) -> None:
    tree = ast.parse((JUDGE / module).read_text())
    offenders = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            offenders += [f"{node.name}: {a}" for a in _annotations(node) if _uses_any(a)]
        if isinstance(node, ast.ClassDef):  # the dataclasses a definition reads
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and _uses_any(ast.unparse(item.annotation)):
                    offenders.append(f"{node.name}.{ast.unparse(item.target)}")
        alias = isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "TypeAlias"
        if alias and node.value is not None and _uses_any(ast.unparse(node.value)):  # Num, ...
            offenders.append(f"{ast.unparse(node.target)} = {ast.unparse(node.value)}")
    assert not offenders, f"{module}: Any in a signature: {offenders}"


def test_mypy_infers_the_kind_each_rule_is_given() -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extra")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "tests/typing/judge_kinds.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
