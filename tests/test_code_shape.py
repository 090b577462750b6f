"""The code's shape: short functions, one codec, no pickles (issue 16's rules, checked)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "llamapool"
MAX_LINES = 80


def _functions() -> list[tuple[int, str]]:
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                found.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(SRC)}:{node.name}"))
    return found


def test_no_function_in_src_is_longer_than_80_lines() -> None:
    long = sorted(f for f in _functions() if f[0] > MAX_LINES)
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_no_pickle_and_no_hand_packed_messages_outside_the_codec() -> None:
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        assert "pickle" not in text and "_pyobj(" not in text, path
        if path.parent.name in ("client", "router", "supervisor", "worker"):
            assert "msgpack.packb" not in text, f"{path}: messages are built by protocol/codec.py"
