"""Do constrained replies parse? Held-out schemas and tool sets on real small models, max_tokens 16 to 256.

    python scripts/structured_check.py MODEL.gguf [--template FILE.jinja] [--max-tokens 16,32,64,128,256]
                                       [--temperature 0] [--only N]

Runs the engine in-process (no daemon) on chat prompts: every schema of ``SCHEMAS`` as
``response_format`` (``json_schema``), every tool set of ``TOOLSETS`` with ``tool_choice``
``required``, and with a ``response_format`` beside ``auto`` tools (a call or an answer), at each
``max_tokens``. A reply counts as valid when its text parses as JSON and validates against its schema
(a call: its arguments against its function's ``parameters``; a forced call must be there). A request
refused up front (``max_tokens`` below what the schema's shortest reply takes) is counted apart.
Prints one JSON line per model: the counts and the first failures. Run it against another checkout
(``PYTHONPATH=OTHER/src``) to compare before and after.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jsonschema

from llamapool.protocol.messages import Run, Step
from llamapool.protocol.params import ParamError, SamplingParams, consistent
from llamapool.worker.engine import Engine, EngineConfig

STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """An object schema as users write them (pydantic, zod): no additionalProperties unless given."""
    out: dict[str, Any] = {"type": "object", "properties": props, **kw}
    if required is not None:
        out["required"] = required
    return out


def arr(items: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **kw}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": STR, "age": INT}, ["name", "age"])),
    ("a city and its population", obj({"city": STR, "population": INT}, ["city", "population"])),
    ("a country", obj({"name": STR, "capital": STR, "population": INT, "area_km2": NUM},
                      ["name", "capital", "population", "area_km2"])),
    ("a book", obj({"title": STR, "author": STR, "year": INT, "isbn": STR}, ["title", "author", "year"])),
    ("a movie review", obj({"movie": STR, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                            "review": STR}, ["movie", "rating", "review"])),
    ("the sentiment of 'I love this!'", obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                             "confidence": NUM}, ["sentiment", "confidence"])),
    ("a todo list", obj({"todos": arr(obj({"task": STR, "done": BOOL}, ["task", "done"]))}, ["todos"])),
    ("three colours", obj({"colours": arr(STR)}, ["colours"])),
    ("a point in 3D", obj({"x": NUM, "y": NUM, "z": NUM}, ["x", "y", "z"])),
    ("a user profile", obj({"username": STR, "email": {"type": "string", "format": "email"},
                            "verified": BOOL}, ["username", "email", "verified"])),
    ("an address", obj({"street": STR, "city": STR, "zip": STR, "country": STR}, ["street", "city", "zip"])),
    ("an order", obj({"id": INT, "items": arr(obj({"sku": STR, "qty": INT, "price": NUM}, ["sku", "qty"])),
                      "total": NUM}, ["id", "items", "total"])),
    ("a recipe", obj({"name": STR, "ingredients": arr(STR), "steps": arr(STR), "minutes": INT},
                     ["name", "ingredients", "steps"])),
    ("an event", obj({"title": STR, "date": {"type": "string", "format": "date"}, "attendees": INT},
                     ["title", "date"])),
    ("a weather report", obj({"city": STR, "temperature_c": NUM, "conditions": {"enum": ["sunny", "cloudy", "rain",
                                                                                         "snow"]}},
                             ["city", "temperature_c", "conditions"])),
    ("a product", obj({"name": STR, "price": NUM, "in_stock": BOOL, "tags": arr(STR)}, ["name", "price"])),
    ("a company", obj({"name": STR, "founded": INT, "employees": INT, "ceo": obj({"name": STR}, ["name"])},
                      ["name", "founded", "ceo"])),
    ("an animal", obj({"species": STR, "legs": INT, "can_fly": BOOL}, ["species", "legs", "can_fly"])),
    ("a list of numbers", obj({"numbers": arr(INT)}, ["numbers"])),
    ("a math answer: 2+2", obj({"answer": INT, "explanation": STR}, ["answer"])),
    ("a classification", obj({"label": STR, "score": NUM}, ["label", "score"])),
    ("a key-value config", obj({"debug": BOOL, "level": STR, "retries": INT})),
    ("a student", obj({"name": STR, "grades": arr(INT), "average": NUM}, ["name", "grades"])),
    ("a flight", obj({"from": STR, "to": STR, "departure": {"type": "string", "format": "date-time"},
                      "passengers": INT}, ["from", "to", "passengers"])),
    ("a song", obj({"title": STR, "artist": STR, "duration_seconds": INT, "genre": STR}, ["title", "artist"])),
    ("a planet", obj({"name": STR, "moons": INT, "has_rings": BOOL, "distance_au": NUM},
                     ["name", "moons", "has_rings"])),
    ("a nullable note", obj({"note": {"anyOf": [STR, {"type": "null"}]}, "count": INT}, ["note", "count"])),
    ("a union value", obj({"value": {"anyOf": [INT, STR, BOOL]}}, ["value"])),
    ("a team", obj({"name": STR, "members": arr(obj({"name": STR, "role": STR}, ["name", "role"]))},
                   ["name", "members"])),
    ("a tree node", {"$defs": {"node": obj({"value": INT, "children": arr({"$ref": "#/$defs/node"})}, ["value"])},
                     "$ref": "#/$defs/node"}),
    ("an invoice", obj({"number": STR, "lines": arr(obj({"desc": STR, "amount": NUM}, ["desc", "amount"]),
                                                     minItems=1), "paid": BOOL}, ["number", "lines", "paid"])),
    ("a translation", obj({"source": STR, "target": STR, "language": STR}, ["source", "target", "language"])),
    ("a rectangle", obj({"width": {"type": "number", "exclusiveMinimum": 0}, "height": NUM}, ["width", "height"])),
    ("an RGB colour", obj({"r": {"type": "integer", "minimum": 0, "maximum": 255},
                           "g": {"type": "integer", "minimum": 0, "maximum": 255},
                           "b": {"type": "integer", "minimum": 0, "maximum": 255}}, ["r", "g", "b"])),
    ("a search query", obj({"query": STR, "filters": obj({"year": INT, "lang": STR}), "limit": INT}, ["query"])),
    ("a summary", obj({"summary": STR, "keywords": arr(STR, maxItems=5)}, ["summary", "keywords"])),
    ("a meeting", obj({"topic": STR, "start": STR, "end": STR, "room": INT}, ["topic", "start", "end"])),
    ("a bank transfer", obj({"from_account": STR, "to_account": STR, "amount": NUM, "currency": {"enum": ["EUR", "USD",
                                                                                                    "GBP"]}},
                            ["from_account", "to_account", "amount", "currency"])),
    ("a chess move", obj({"piece": {"enum": ["king", "queen", "rook", "bishop", "knight", "pawn"]}, "from": STR,
                          "to": STR}, ["piece", "from", "to"])),
    ("a matrix", obj({"rows": arr(arr(INT))}, ["rows"])),
    ("an HTTP request", obj({"method": {"enum": ["GET", "POST"]}, "url": STR,
                             "headers": {"type": "object", "additionalProperties": STR}}, ["method", "url"])),
    ("anything as JSON", {"type": "object"}),
    ("a yes/no answer", obj({"answer": BOOL}, ["answer"])),
    ("an integer", INT),
    ("a list of people", arr(obj({"name": STR, "age": INT}, ["name", "age"]))),
]

TOOLSETS: list[tuple[str, list[dict[str, Any]]]] = []


def fn(name: str, desc: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


TOOLSETS = [
    ("What is the weather in Paris?", [fn("get_weather", "Weather in a city", obj({"city": STR}, ["city"]))]),
    ("Add 2 and 3", [fn("add", "Add two numbers", obj({"a": INT, "b": INT}, ["a", "b"]))]),
    ("Send an email to bob@example.com saying hi", [fn("send_email", "Send an email", obj(
        {"to": STR, "subject": STR, "body": STR}, ["to", "body"]))]),
    ("Book a table for 4 at 7pm", [fn("book", "Book a restaurant table", obj(
        {"people": INT, "time": STR, "name": STR}, ["people", "time"]))]),
    ("Search the web for llamas", [fn("search", "Web search", obj({"query": STR, "max_results": INT}, ["query"])),
                                   fn("open_url", "Open a page", obj({"url": STR}, ["url"]))]),
    ("Convert 10 USD to EUR", [fn("convert", "Convert currency", obj(
        {"amount": NUM, "from": STR, "to": STR}, ["amount", "from", "to"]))]),
    ("Set a timer for 5 minutes", [fn("set_timer", "Set a timer", obj({"minutes": INT, "label": STR}, ["minutes"]))]),
    ("Create a user Ann, 31", [fn("create_user", "Create a user", obj(
        {"name": obj({"first": STR, "last": STR}, ["first"]), "age": INT}, ["name", "age"]))]),
    ("Turn on the kitchen lights", [fn("lights", "Switch lights", obj(
        {"room": STR, "on": BOOL, "brightness": {"type": "integer", "minimum": 0, "maximum": 100}},
        ["room", "on"]))]),
    ("Translate 'hello' to French", [fn("translate", "Translate text", obj({"text": STR, "to": STR},
                                                                            ["text", "to"]))]),
    ("Record success", [fn("record", "Record an outcome", obj({"success": BOOL}, ["success"]))]),
    ("Add tags a, b and c", [fn("tag", "Tag an item", obj({"tags": arr(STR)}, ["tags"]))]),
]

ANSWER = obj({"answer": STR}, ["answer"])  # the response_format beside auto tools


def cases(max_tokens: list[int], temperature: float) -> list[tuple[str, Any, SamplingParams, Any]]:
    """(kind, prompt, params, what checks the reply) of every request."""
    out: list[tuple[str, Any, SamplingParams, Any]] = []
    for mt in max_tokens:
        base = {"max_tokens": mt, "temperature": temperature, "seed": 7}
        for i, (what, schema) in enumerate(SCHEMAS):
            hint = f" Use this JSON schema: {json.dumps(schema)}" if i % 2 else ""
            msgs = [{"role": "user", "content": f"Give me {what} as JSON.{hint}"}]
            rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
            out.append(("schema", msgs, SamplingParams(**base, response_format=rf), schema))
        for ask, tools in TOOLSETS:
            msgs = [{"role": "user", "content": ask}]
            out.append(("tools", msgs, SamplingParams(**base, tools=tools, tool_choice="required"), tools))
            p = SamplingParams(**base, tools=tools, tool_choice="auto", response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
            out.append(("union", msgs, p, tools))
    return out


def problem(kind: str, text: str, calls: list[dict[str, Any]] | None, want: Any) -> str:
    """Why a reply is not valid ("" when it is)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in want} if kind != "schema" else {}
    try:
        if calls:
            for c in calls:
                jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
            return ""
        if kind == "tools":
            return "no tool call"
        jsonschema.validate(json.loads(text), ANSWER if kind == "union" else want)
        return ""
    except (ValueError, KeyError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


def run(model: str, template: str, max_tokens: list[int], temperature: float, only: int) -> dict[str, Any]:
    todo = cases(max_tokens, temperature)
    if only:
        todo = todo[:only]
    eng = Engine(EngineConfig(model, slots=16, ctx_per_slot=2048, chat_template=template))
    results: dict[str, dict[str, int]] = {}
    failures: list[dict[str, Any]] = []
    try:
        pending: dict[int, tuple[str, Any, SamplingParams, Any]] = {}
        for rid, case in enumerate(todo):
            kind, msgs, p, _ = case
            tally = results.setdefault(kind, {"valid": 0, "invalid": 0, "refused": 0, "length": 0, "total": 0})
            tally["total"] += 1
            try:
                consistent(p)
            except ParamError as e:  # this checkout refuses the combination
                tally["refused"] += 1
                failures.append({"kind": kind, "max_tokens": p.max_tokens, "refused": e.field})
                continue
            pending[rid] = case
            step = Step()
            eng.submit(Run(rid, msgs, p, False), step)
            _collect(step, pending, results, failures)
        while eng.busy:
            _collect(eng.step(), pending, results, failures)
    finally:
        eng.close()
    invalid = [f for f in failures if "refused" not in f]
    return {"model": model, "temperature": temperature, "max_tokens": max_tokens, "results": results,
            "invalid": invalid[:12], "refused": [f for f in failures if "refused" in f][:4],
            "failure_count": len(failures)}


def _collect(step: Step, pending: dict[int, Any], results: dict[str, dict[str, int]],
             failures: list[dict[str, Any]]) -> None:
    for f in step.failed:
        kind, _, p, _ = pending.pop(f.rid)
        results[kind]["refused"] += 1
        failures.append({"kind": kind, "max_tokens": p.max_tokens, "refused": f.field, "why": f.message[:100]})
    for d in step.done:
        kind, msgs, p, want = pending.pop(d.rid)
        why = problem(kind, d.text, d.tool_calls, want)
        tally = results[kind]
        tally["length"] += d.reason == "length"
        tally["invalid" if why else "valid"] += 1
        if why:
            failures.append({"kind": kind, "max_tokens": p.max_tokens, "reason": d.reason, "why": why,
                             "ask": msgs[0]["content"][:40], "text": d.text[-80:]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--template", default="")
    ap.add_argument("--max-tokens", default="16,32,64,128,256")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--only", type=int, default=0, help="the first N requests only")
    args = ap.parse_args()
    mts = [int(x) for x in args.max_tokens.split(",")]
    print(json.dumps(run(args.model, args.template, mts, args.temperature, args.only)))


if __name__ == "__main__":
    main()
