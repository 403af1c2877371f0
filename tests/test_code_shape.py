"""The code's shape, checked like lint: no function in gridtrain/ is longer than 60 lines.

Long functions hide several steps behind one name; issue 25 set the bound (picotron's
longest is about 60 lines). Counted from the first decorator to the last line, docstring
included, so a split is the only way under it.
"""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 60
PACKAGE = Path(__file__).resolve().parents[1] / "gridtrain"


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length in lines) of every function and method in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append((node.name, node.lineno, node.end_lineno - start + 1))
    return out


def test_the_counter_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    lengths = function_lengths(f"@staticmethod\ndef f():\n{body}\n")
    assert lengths == [("f", 2, MAX_LINES + 2)]


def test_no_function_in_gridtrain_exceeds_the_bound():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {name} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, n in function_lengths(path.read_text())
        if n > MAX_LINES
    ]
    assert not long, f"functions over {MAX_LINES} lines: split them\n" + "\n".join(long)
