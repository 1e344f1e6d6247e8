"""The house keeps its shape: no file in ``trident/`` over 650 lines, no class over 400, no
function over 80 (an AST walk; decorators and docstrings count). A wing that outgrows these is
split by job, the way ``pipeline/`` and ``weights/`` are (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "trident"
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 650, 400, 80


def _span(node: ast.AST) -> int:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def _oversized() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT.parent)
        if (lines := len(text.splitlines())) > MAX_FILE:
            found.append(f"{name}: {lines} lines (file limit {MAX_FILE})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and _span(node) > MAX_CLASS:
                found.append(f"{name}:{node.lineno} class {node.name}: {_span(node)} lines")
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and _span(node) > MAX_FUNCTION
            ):
                found.append(f"{name}:{node.lineno} {node.name}(): {_span(node)} lines")
    return found


def test_no_file_class_or_function_outgrows_its_limit():
    found = _oversized()
    assert not found, "\n".join(found)


def test_the_walk_sees_the_package():
    # guards the test above against a wrong root: the walk must find trident's main modules
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")}
    assert {"cli/main.py", "pipeline/sync.py", "weights/sync.py", "train/policy.py"} <= files
