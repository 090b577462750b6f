"""JSON schemas as constraints: the bounds that make a constrained reply end, added where a schema has none.

A schema obeyed token by token still lets a small model run on: invent property after property,
write an integer of a thousand digits, or a string that never closes. Before a schema is compiled,
:func:`bounded` adds, wherever the schema does not say otherwise:

- ``additionalProperties: false`` on every object schema that declares ``properties`` (OpenAI's
  ``strict`` semantics; vLLM's guidance backend does the same). ``additionalProperties: true`` (or
  any schema for them), ``unevaluatedProperties``, and the branches of an ``allOf`` (whose properties
  are merged, so that each branch's own would forbid the others') are left as they are;
- integers within ``±INT_BOUND`` (18 digits: inside int64);
- numbers within ``±NUMBER_BOUND``, in steps of ``NUMBER_STEP`` (at most 15 digits before the point
  and 6 after it, no exponent);
- strings of at most ``MAX_STRING`` characters.

A bound the schema gives (``minimum``, ``maximum``, ``exclusiveMinimum``/``Maximum``, ``multipleOf``,
``maxLength``) is kept as given; ``enum`` and ``const`` need none. Compact JSON (no whitespace between
tokens) is llguidance's ``whitespace_flexible: false``, the default of every JSON grammar here; a
schema's own ``x-guidance`` options override it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

INT_BOUND = 10**18 - 1
NUMBER_BOUND = 1e15
NUMBER_STEP = 1e-6
MAX_STRING = 1024
COMPACT: JsonCompileOptions = {"whitespace_flexible": False}  # llguidance's: no runs of whitespace to wander in

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # lists of schemas
_ONES = ("additionalProperties", "items", "additionalItems", "not", "if", "then", "else", "contains",
         "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # one schema


def bounded(schema: Any) -> Any:
    """A copy of ``schema`` with the bounds above added where it gives none (``schema`` is not changed)."""
    return _walk(schema, merged=False)


def _walk(s: Any, merged: bool) -> Any:
    if not isinstance(s, dict):
        return s  # true, false, or something llguidance will name as invalid
    out = dict(s)
    for k in _MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _walk(v, False) for name, v in out[k].items()}
    for k in _LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_walk(v, k == "allOf") for v in out[k]]
    for k in _ONES:
        v = out.get(k)
        if isinstance(v, dict):
            out[k] = _walk(v, False)
        elif k == "items" and isinstance(v, list):  # draft 4's tuple form
            out[k] = [_walk(i, False) for i in v]
    if ("properties" in out or "patternProperties" in out) and not merged \
            and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "enum" not in out and "const" not in out:
        _bound_scalars(out)
    return out


def _bound_scalars(out: dict[str, Any]) -> None:
    kinds = out.get("type")
    types = set(kinds) if isinstance(kinds, list) else {kinds}
    if "integer" in types or "number" in types:
        bound: float = INT_BOUND if "number" not in types else NUMBER_BOUND
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -bound
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = bound
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    if "string" in types and "maxLength" not in out:
        out["maxLength"] = max(MAX_STRING, out.get("minLength", 0) if isinstance(out.get("minLength"), int) else 0)
