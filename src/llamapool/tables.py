"""TOML tables into frozen dataclasses, checked by msgspec against the fields' declared types.

A field declares what it takes: its type, ``Annotated`` constraints (``msgspec.Meta``: ranges, lengths,
patterns, and a ``description`` that errors quote), ``Literal`` choices, and :class:`Parse` for a value
written in another form ("90s" for seconds). Every error names the key's full path and what it takes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from llamapool.errors import ConfigError

T = TypeVar("T")
_AT = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>.*)`)?", re.S)
_RANGE = re.compile(r"Expected `\w+` [<>]")
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a table",
          tuple: "a list", list: "a list"}


@dataclass(frozen=True)
class Parse:
    """A field's marker (in its ``Annotated``): ``fn`` turns the TOML value into the declared type's form
    before msgspec checks it, raising ValueError when it cannot (or a ConfigError of its own); ``expects``
    says what the key takes, and ``unit`` follows a range in an error (">= 0 seconds")."""

    fn: Callable[[Any], Any]
    expects: str = ""
    unit: str = ""


def _seconds(value: Any) -> Any:
    """Seconds from a duration string: "90s", "15m", "2h", "1h30m" (any other value as it is)."""
    if not isinstance(value, str):
        return value
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*", value)
    if not value.strip() or parts is None or not any(parts.groups()):
        raise ValueError(value)
    h, m, sec = (float(g or 0) for g in parts.groups())
    return h * 3600 + m * 60 + sec


def _env(value: Any) -> Any:
    """An environment table's numbers and booleans as the strings a process environment holds (true -> "1")."""
    if not isinstance(value, dict):
        return value
    return {k: str(int(v)) if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v
            for k, v in value.items()}


def _stripped(value: Any) -> Any:
    return [v.strip() if isinstance(v, str) else v for v in value] if isinstance(value, list) else value


# kinds of value a key may declare
DURATION = Parse(_seconds, 'seconds or a duration such as "90s", "15m", "2h"', unit="seconds")
Timeout = Annotated[float, Meta(gt=0)]  # seconds, > 0
Duration = Annotated[float, Meta(gt=0), DURATION]  # seconds, > 0, or a duration string
Wait = Annotated[float, Meta(ge=0), DURATION]  # seconds, >= 0, or a duration string
Names = Annotated[tuple[Annotated[str, Meta(min_length=1)], ...], Meta(description="a list of non-empty strings"),
                  Parse(_stripped)]
Env = Annotated[dict[str, str], Meta(description='a table of NAME = "value"'), Parse(_env)]  # environment


def table(key: str, cls: type[T], raw: Any, defaults: Mapping[str, Any] | None = None,
          moved: Mapping[str, str] | None = None) -> T:
    """``cls`` from the TOML table ``raw`` found at ``key`` (its absent keys from ``defaults``, else the
    declared defaults); ``moved`` explains, by name, a key that was renamed or removed."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: must be a table")
    hints = _hints(typing.cast(type, cls))
    values = dict(defaults or {})
    for name, value in raw.items():
        if moved and name in moved:
            raise ConfigError(f"{key}.{name}: {moved[name]}")
        if name not in hints:
            raise ConfigError(f"{key}.{name}: unknown key (known: {', '.join(sorted(hints))})")
        parse = _marker(hints[name], Parse)
        try:
            values[name] = parse.fn(value) if parse else value
        except ConfigError:  # its own message
            raise
        except ValueError:
            raise ConfigError(f"{key}.{name}: must be {_expects(hints[name], '')}, got {value!r}") from None
    try:
        return msgspec.convert(values, cls)
    except msgspec.ValidationError as e:
        raise ConfigError(_message(key, hints, {**(defaults or {}), **raw}, str(e))) from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` and their declared types, ``Annotated`` extras kept (once a class)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _message(key: str, hints: dict[str, Any], given: dict[str, Any], error: str) -> str:
    """msgspec's ``error`` ("Expected `int` >= 1 - at `$.slots`") as the key's: what it takes, and the value
    ``given``."""
    m = _AT.fullmatch(error)
    what, path = (m["what"], m["path"] or "") if m else (error, "")
    field = re.match(r"\.(\w+)", path)
    if field is None:  # the table itself: a required key missing
        missing = re.fullmatch(r"Object missing required field `(\w+)`", what)
        if missing is None:
            return f"{key}: {what}"
        about = _description(hints[missing[1]])
        return f"{key}.{missing[1]}: is required" + (f" ({about})" if about else "")
    name = field[1]
    inner = "" if path != field[0] else what  # an error inside a list or a table: the key's whole rule
    return f"{key}.{name}: must be {_expects(hints[name], inner)}, got {given[name]!r}"


def _expects(hint: Any, what: str) -> str:
    """What a field of type ``hint`` takes, for an error; a range alone when ``what`` says it was out of it."""
    base, extras = _unwrap(hint)
    about = _description(hint)
    if about:
        return about
    if typing.get_origin(base) is Literal:
        return choices(typing.get_args(base))
    parse = _marker(hint, Parse)
    if _RANGE.match(what):
        bounds = [f"{op} {getattr(m, attr)}" for m in extras if isinstance(m, msgspec.Meta)
                  for attr, op in _BOUNDS if getattr(m, attr) is not None]
        return " and ".join(bounds) + (f" {parse.unit}" if parse and parse.unit else "")
    if parse and parse.expects:
        return parse.expects
    return _NAMES.get(typing.get_origin(base) or base, what or "a valid value")


def choices(values: tuple[Any, ...]) -> str:
    """``("a", "b", "c")`` as ``"a", "b" or "c"``."""
    quoted = [f'"{v}"' if isinstance(v, str) else repr(v) for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _unwrap(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    if typing.get_origin(hint) is Annotated:
        return hint.__origin__, hint.__metadata__
    return hint, ()


def _description(hint: Any) -> str:
    return next((m.description for m in _unwrap(hint)[1] if isinstance(m, msgspec.Meta) and m.description), "")


def _marker(hint: Any, kind: type[T]) -> T | None:
    return next((m for m in _unwrap(hint)[1] if isinstance(m, kind)), None)
