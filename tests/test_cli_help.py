"""Help that answers: every command and option says what it does, and its default."""

from __future__ import annotations

import argparse
import subprocess
import sys

from llamapool.cli import build_parser


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_command_has_help_and_shows_its_default() -> None:
    for name, sub in _subparsers(build_parser()).items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"llamapool {name}: {action.dest} has no help text"
            if action.option_strings and action.default not in (None, False):
                shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
                assert f"default: {shown}" in " ".join(text.split()), f"llamapool {name} {action.dest}: no default"


def test_the_top_level_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "llamapool.cli", "--help"], capture_output=True, text=True).stdout
    for name, sub in _subparsers(build_parser()).items():
        assert name in out, name
        assert sub.description, name
    assert "node" in out and "fetch-model" in out


def test_serve_help_points_at_the_default_config_and_says_how_to_stop() -> None:
    out = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--help"], capture_output=True,
                         text=True).stdout
    assert "configs/default.toml" in out
    assert "second Ctrl-C" in out


def test_version_names_llamapool_and_llama_cpp_python_without_loading_llama_cpp() -> None:
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "llamapool.cli", "--version"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"llamapool {version('llamapool')} (llama-cpp-python {version('llama-cpp-python')}")
    assert "llama_cpp" not in out.stderr  # -X importtime lists every module imported


def test_status_prints_rounded_figures_with_units_and_each_line_once(capsys) -> None:  # type: ignore[no-untyped-def]
    from llamapool.cli import print_status

    worker = {"id": "gpu0", "model": "m", "pid": 7, "device": "GPU-1", "state": "ready", "slots": 8, "active": 2,
              "restarts": 0, "last_exit": None, "step_target": "auto", "step_budget": 512,
              "step_cost_ms": {"base": 0.0, "per_row": 44.1556, "per_prompt_token": 3.23306, "prompt_step": 15.1755}}
    gpu = {"index": 0, "name": "H200", "memory_used": 3 << 30, "memory_total": 143 << 30, "utilization": 97,
           "temperature": 51}
    print_status({"models": [{"name": "m", "workers": ["gpu0"], "queued": 0, "running": 2}], "workers": [worker],
                  "gpus": [gpu], "queued": 0, "running": 2, "draining": False})
    out = capsys.readouterr().out
    assert ("gpu0: steps sized by target_step auto, last budget 512 tokens; step cost 44 ms a sequence + "
            "3.2 ms a prompt token + 15 ms a step with prompt work") in out, out
    assert "GPU 0 H200: 3.0/143.0 GiB, 97% busy, 51 °C" in out, out
    assert out.count("queued 0, running 2") == 1, out
    lines = out.splitlines()
    assert len(lines) == len(set(lines)), out
