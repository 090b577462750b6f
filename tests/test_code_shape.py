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


# the classes that carry a model's engine settings from the config file to the engine
SETTINGS_CARRIERS = {"config.py": "ModelConfig", "worker/server.py": "WorkerSpec",
                     "worker/engine/model.py": "EngineConfig"}


def test_each_engine_setting_is_declared_once() -> None:
    """A model's engine settings (and their defaults) are declared in worker/settings.py alone: the config's
    model, the worker's spec and the engine's config extend EngineSettings rather than copy its fields."""
    import dataclasses

    from llamapool.worker.settings import EngineSettings

    names = {f.name for f in dataclasses.fields(EngineSettings)}
    assert len(names) >= 14
    for path, cls in SETTINGS_CARRIERS.items():
        tree = ast.parse((SRC / path).read_text())
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
        assert "EngineSettings" in [ast.unparse(b) for b in node.bases], f"{path}:{cls} does not extend EngineSettings"
        own = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        assert not own & names, f"{path}:{cls} declares engine settings again: {sorted(own & names)}"


def _max_tokens_literals(path: Path) -> list[str]:
    """Where ``path`` writes a max_tokens default as a number: an argument of ``common`` (the OpenAI doors'
    parameter reader), ``max_... or N``, ``{"max_tokens": N}``, or ``1 << 20``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        values: list[ast.expr] = []
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) and \
                (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "common":
            values = node.args[1:]
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and "max_" in ast.unparse(node.values[0]):
            values = node.values[1:]
        elif isinstance(node, ast.Dict):
            values = [v for k, v in zip(node.keys, node.values, strict=True)
                      if isinstance(k, ast.Constant) and k.value == "max_tokens"]
        elif isinstance(node, ast.BinOp) and ast.unparse(node) == "1 << 20":
            values = [node]
        found += [f"{path.relative_to(SRC)}:{v.lineno}: {ast.unparse(v)}" for v in values
                  if isinstance(v, ast.BinOp) or (isinstance(v, ast.Constant) and type(v.value) is int)]
    return found


def test_each_doors_max_tokens_default_is_declared_once() -> None:
    """The max_tokens defaults (16 for completions, until the end for chat and responses, required for
    Anthropic's messages, 128 for the SDK) are declared in protocol/params.py alone; the doors name them."""
    paths = [*(SRC / "gateway").rglob("*.py"), *(SRC / "client").rglob("*.py"), SRC / "cli.py"]
    found = sorted({f for p in paths for f in _max_tokens_literals(p)})
    assert not found, f"max_tokens defaults written outside protocol/params.py: {found}"
    cli = ast.parse((SRC / "cli.py").read_text())
    assert "DEFAULT_MAX_TOKENS" in ast.unparse(cli) and "_sampling_args(g, 128)" not in ast.unparse(cli)
