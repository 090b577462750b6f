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
