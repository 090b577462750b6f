"""CPU costs of constrained decoding on a real vocabulary: grammar compilation, mask filling, mask use.

    python scripts/constraint_costs.py MODEL.gguf [--rows 64]

Prints one JSON line: the time to compile a 10-function tool grammar and a JSON schema (first time,
and from the cache), the time to fill ``rows`` next-token masks in parallel (p50/p99 over 50 steps
of matchers advanced along a valid JSON text), the time of the per-row checks the sampler makes
(a bit test when the sampled token is allowed; the full-row mask when it is refused), and what the
budget-aware closing costs a token along a reply of the schema: the matcher's own ``consume_token``
(what a token cost before it), ``Closing.take`` far from the end of the budget (every token but a
reply's last ones), and ``take`` where every token is checked (a reply's last tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llama_cpp as L
import numpy as np

from llamapool.protocol.params import SamplingParams
from llamapool.worker.constraints import Compiled, Grammars, Masks, spec_of
from llamapool.worker.tools import ToolFormat


def tools(n: int) -> list[dict[str, object]]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": f"tool number {i}", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["city", "unit"], "additionalProperties": False}}} for i in range(n)]


def closing_costs(grammars: Grammars, compiled: Compiled) -> dict[str, float]:
    """Microseconds a token (p50, p99) of a reply of the schema, three ways (see the docstring)."""
    reply = '{"text":"' + "a long free string, with words in it " * 6 + '","list":["one","two","three"],"n":42}'
    toks = grammars.tokenizer().tokenize_str(reply)
    out: dict[str, float] = {"closing_plan_from_start_tokens": float(compiled.closing or -1), "reply_tokens": len(toks)}
    for name in ("consume", "take_far", "take_checked"):
        times: list[float] = []
        for _ in range(20):
            m = compiled.matcher.deep_copy()
            closing = grammars.start(compiled, 1 << 20 if name == "take_far" else len(toks) + 24)
            closing.matcher = m
            if name == "take_checked":  # every token in the window (the reply fits: none is replaced)
                closing.window = 1 << 20
            for tok in toks:
                t = time.perf_counter()
                if name == "consume":
                    m.consume_token(tok)
                else:
                    closing.take(tok)
                times.append(time.perf_counter() - t)
            assert not m.is_error() and m.is_accepting()
        times.sort()
        out[f"{name}_p50_us"] = round(times[len(times) // 2] * 1e6, 2)
        out[f"{name}_p99_us"] = round(times[int(0.99 * (len(times) - 1))] * 1e6, 2)
        out[f"{name}_mean_us"] = round(statistics.fmean(times) * 1e6, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    grammars = Grammars(vocab, n_vocab, frozenset({L.llama_vocab_eos(vocab)}))
    t = time.perf_counter()
    grammars.tokenizer()
    tokenizer_s = time.perf_counter() - t
    out: dict[str, object] = {"n_vocab": n_vocab, "tokenizer_s": round(tokenizer_s, 3)}
    ten = spec_of(SamplingParams(tools=tools(10), tool_choice="required"), ToolFormat("hermes"))
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "list": {"type": "array", "items": {
        "type": "string"}}, "n": {"type": "integer"}}, "required": ["text", "list", "n"]}
    js = spec_of(SamplingParams(json_schema=schema), None)
    assert ten is not None and js is not None
    for name, spec in (("tools10", ten), ("json_schema", js)):
        t = time.perf_counter()
        grammars.compile(spec).result()
        first = time.perf_counter() - t
        t = time.perf_counter()
        grammars.compile(spec).result()
        out[f"compile_{name}_ms"] = round(first * 1e3, 2)
        out[f"cached_{name}_ms"] = round((time.perf_counter() - t) * 1e3, 3)
    template = grammars.compile(js).result().matcher
    matchers = [template.deep_copy() for _ in range(args.rows)]
    text = '{"text": "' + "a long free string " * 20
    toks = grammars.tokenizer().tokenize_str(text)
    masks = Masks(args.rows, n_vocab)
    fills = []
    for step in range(min(50, len(toks))):
        t = time.perf_counter()
        masks.start([(m, i) for i, m in enumerate(matchers)])
        masks.wait()
        fills.append(time.perf_counter() - t)
        for m in matchers:
            m.consume_token(toks[step])
    fills.sort()
    out["fill_rows"] = args.rows
    out["fill_p50_ms"] = round(statistics.median(fills) * 1e3, 3)
    out["fill_p99_ms"] = round(fills[int(0.99 * (len(fills) - 1))] * 1e3, 3)
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    t = time.perf_counter()
    for _ in range(1000):
        masks.allows(0, 1234)
    out["check_allowed_us"] = round((time.perf_counter() - t) * 1e3, 3)
    t = time.perf_counter()
    for _ in range(100):
        int(np.where(masks.allowed(0), logits, -np.inf).argmax())
    out["masked_argmax_row_ms"] = round((time.perf_counter() - t) * 10, 3)
    out.update(closing_costs(grammars, grammars.compile(js).result()))
    print(json.dumps(out))
    masks.close()
    grammars.close()


if __name__ == "__main__":
    main()
