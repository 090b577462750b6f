#!/usr/bin/env python3
"""Speculative decoding at a known acceptance (issue 34, measurement (a)): an oracle draft, in-process.

The engine runs in this process (no router, no sockets), on GPU 0 by default. For each batch size B:

1. **off**: N random-token prompts (P tokens each), greedy, G tokens each (EOS ignored), B at a time,
   speculation off (the request's ``speculative: false``): every sequence's output is recorded, and
   this run is the "off" figure;
2. **oracle**: the same requests with speculation on and drafts from an oracle (``Speculator.proposer``):
   a sequence's draft at output position ``i`` is the recorded output ``i .. i+k-1``, each token
   replaced by another one with probability ``1 - alpha`` (a fixed seed; the same corruption for every
   k), so each draft token is accepted with probability ``alpha`` (given the one before it was), or,
   with ``--span S``, in runs (right tokens in runs of mean S, wrong ones in runs of mean
   S (1 - alpha) / alpha: text that copies a passage, then writes its own). For
   each alpha and each k: ``k`` = 3, 5, 7 ... drafts every step (the step budget bypassed: the verify
   cost as k grows), and ``budget`` (the engine's own choice: the step budget and the per-sequence
   acceptance estimate decide, up to spec.MAX_DRAFT);
3. **random**: alpha 0 under the step budget (drafts that never pay: the budget should keep them out;
   target at 64 streams >= 0.98x of off); **no-draft**: speculation on but nothing ever drafted (what
   being a speculating request costs by itself);
4. **llama-server** (``--llama-server PATH``): the same requests over its HTTP API, B slots, B streams
   (it decodes without speculation).

Greedy output with drafts must be the recorded one (a mismatch is reported, not asserted: at a near-tie
a batch of several rows of one sequence may round otherwise). So use a ``make-model --peaked`` model:
the plain random one's tensors and decode cost, but each greedy token wins by tens of logits (a plain
random model's logits are near-ties: on a GPU its output departed from the recording at once, and an
"alpha 1.0" draft was kept 4 % of the time). Each row: tok/s (tokens / wall, prompts included, as the
llama-server driver counts), decode tok/s and ms a step (steps without prompt work;
llama-server's: B / ITL p50 and ITL p50), tokens a step (a sequence's, per step it samples in), drafts
a sequence-step, the acceptance achieved (``alpha``: per draft token given the one before was kept,
``accepted / (accepted + rejections)``; ``acceptance``: accepted / verified, the engine's counter),
mismatched sequences, and where the rows were sampled (``graph``: llama.cpp's backend sampling in the
decode graph; ``host``: logits copied to the host). On a GPU with ``gpu_sampling`` (the default) these
greedy requests' rows, drafts and all, are sampled in the graph (``Sampling.verifies``: llamapool's greedy
takes any number of a sequence's rows; before 2026-11-26 a speculating sequence was sampled on the host,
drafts or not). Under ``target_step = "auto"`` (the default) a decode step's token budget is its
rows + 64, so at 64 streams the budget's rows carry at most 64 drafts a step (``--target-step off``
lifts that); fixed-k rows run with "off".

Prints JSON lines (one per row; also appended to ``--out FILE``, the table to ``FILE.md``) and a
markdown table. On the GPU machine (after ``. scripts/gpu-job.sh``), at the 1B shape, about 3-5 minutes
with ``--repeats 3`` (``--stop-after S``: no run starts after S seconds):

    python3 -m llamapool.cli make-model /tmp/m1b.gguf --n-embd 2048 --n-layer 16 --n-head 32 \\
        --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0 --peaked
    python3 tests/spec_oracle.py /tmp/m1b.gguf --device 0 --repeats 3 --stop-after 480 \\
        --llama-server /tmp/lsa/llama-server --out "$OUT/spec_oracle_1b.jsonl"

On a CPU (checks the script; the tiny model's speeds mean nothing):

    python3 -m llamapool.cli make-model /tmp/tiny.gguf --peaked
    PYTHONPATH=src .venv/bin/python tests/spec_oracle.py /tmp/tiny.gguf --cpu --batch 1 4 --gen 32
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # --device: before llama.cpp loads CUDA, which reads CUDA_VISIBLE_DEVICES once
    for _i, _a in enumerate(sys.argv):
        if _a == "--device" and _i + 1 < len(sys.argv):
            os.environ["CUDA_VISIBLE_DEVICES"] = sys.argv[_i + 1]
        elif _a.startswith("--device="):
            os.environ["CUDA_VISIBLE_DEVICES"] = _a.partition("=")[2]

import llama_cpp  # noqa: F401, I001 - before numpy: CUDA model loads segfaulted after numpy/pyzmq imports

import argparse
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llamapool.bench.workloads import FIRST_ID
from llamapool.protocol.messages import Run, SamplingParams, Step
from llamapool.worker.engine import Engine, EngineConfig, visible_gpus
from llamapool.worker.engine.sequence import Sequence
from llamapool.worker.engine import spec
from llamapool.worker.engine.ngram import PromptLookup
from llamapool.worker.engine.spec import MAX_DRAFT, Calls, Drafting, Proposer
from llamapool.worker.scheduler import StepTarget

BUDGET = "budget"  # k chosen by the engine (step budget, acceptance estimate), up to MAX_DRAFT


@dataclass(frozen=True)
class Case:
    """One measured configuration: ``mode`` off, oracle (at ``alpha``), random (alpha 0) or no-draft;
    ``k`` drafts every step, or ``BUDGET``."""

    mode: str
    k: int | str | None = BUDGET  # None: no drafts (off)
    alpha: float | None = None


class RecordingEngine(Engine):
    """The engine, keeping each finished sequence's output tokens and where its rows were sampled."""

    def __init__(self, cfg: EngineConfig):
        super().__init__(cfg)
        self.outputs: dict[int, np.ndarray] = {}
        self.in_graph: dict[int, bool] = {}

    def _release(self, seq: Sequence) -> None:
        self.outputs[seq.rid] = seq.history[len(seq.tokens): seq.n_history].copy()
        self.in_graph[seq.rid] = seq.sampling.in_graph
        super()._release(seq)


class Oracle:
    """The proposer: request ``rid``'s recorded output from the draft's place on, corrupted at a set rate
    (drawn once for all positions: every k sees the same corruption). A draft ends after a token the
    model ends generation with (the engine verifies no row after one)."""

    def __init__(self, prompt_len: dict[int, int], recorded: dict[int, np.ndarray], alpha: float, n_vocab: int,
                 eog: frozenset[int], seed: int = 0, span: float = 0.0):
        rng = np.random.default_rng(seed)
        self.prompt_len = prompt_len
        self.eog = eog
        self.drafts: dict[int, np.ndarray] = {}
        bad = np.fromiter(sorted(eog), np.int64) if eog else np.zeros(0, np.int64)
        for rid in sorted(recorded):
            toks = recorded[rid].astype(np.int64)
            keep = rng.random(len(toks)) < alpha if not span else runs(len(toks), alpha, span, rng)
            other = rng.integers(FIRST_ID, n_vocab - 1, len(toks))  # uniform over [FIRST_ID, n_vocab) - {tok}
            other = np.where(other >= toks, other + 1, other)
            for j in np.flatnonzero(np.isin(other, bad)):  # never an end-of-generation token
                while other[j] in eog or other[j] == toks[j]:
                    other[j] = rng.integers(FIRST_ID, n_vocab)
            self.drafts[rid] = np.where(keep, toks, other)

    def __call__(self, rid: int, hist: np.ndarray, k: int) -> list[int]:
        at = len(hist) - self.prompt_len[rid]
        draft = [int(t) for t in self.drafts[rid][at: at + k]]
        for j, t in enumerate(draft):
            if t in self.eog:
                return draft[: j + 1]
        return draft


def runs(n: int, alpha: float, span: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` positions, right (True) with probability ``alpha``, in runs: right ones of mean length ``span``,
    wrong ones of mean ``span (1 - alpha) / alpha`` (at least 1)."""
    out: list[bool] = []
    while len(out) < n:
        right = bool(rng.random() < alpha)
        mean = span if right else max(span * (1 - alpha) / max(alpha, 1e-9), 1.0)
        out += [right] * max(1, round(rng.exponential(mean)))
    return np.array(out[:n], bool)


def no_draft(rid: int, hist: np.ndarray, k: int) -> list[int]:
    """A proposer that never drafts."""
    return []


@dataclass
class Verified:
    """Each step's verified drafts, counted as ``Drafting.verified`` sees them."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # steps where a draft token was refused (the first refused one)
    lengths: dict[int, int] = field(default_factory=dict)  # draft length -> steps

    @property
    def alpha(self) -> float | None:
        """Per draft token, given the one before it was kept."""
        n = self.accepted + self.rejections
        return self.accepted / n if n else None


@contextmanager
def counting() -> Iterator[Verified]:
    """``Drafting.verified`` wrapped while the block runs: every verified draft counted."""
    v = Verified()
    real = Drafting.verified

    def verified(self: Drafting, drafted: int, accepted: int) -> None:
        if drafted:
            v.steps += 1
            v.drafted += drafted
            v.accepted += accepted
            v.rejections += accepted < drafted
            v.lengths[drafted] = v.lengths.get(drafted, 0) + 1
        real(self, drafted, accepted)

    Drafting.verified = verified  # type: ignore[method-assign]
    try:
        yield v
    finally:
        Drafting.verified = real  # type: ignore[method-assign]


@contextmanager
def every_step(engine: Engine) -> Iterator[None]:
    """Every step carries each speculating sequence's k drafts: the step's width is its longest draft (the
    measured widths' costs bypassed, every draft worth making), the token budget at ``max_batch_tokens``
    (``target_step = "off"``: under "auto" a decode step's budget is its rows + 64); a draft is as long
    as the request's k allows."""
    target, least = engine.target, engine.spec.least_chance
    engine.target = StepTarget.parse("off")
    engine.spec.least_chance = 0.0  # every draft made, however often refused
    setattr(engine.spec, "width_cost", lambda n_rows, rows, prefilling: (lambda k: 1.0))  # noqa: B010 - the instance's
    setattr(engine.spec.widths, "choose", longest_draft)  # noqa: B010
    try:
        yield
    finally:
        engine.target, engine.spec.least_chance = target, least
        del engine.spec.width_cost  # type: ignore[method-assign]
        del engine.spec.widths.choose  # type: ignore[attr-defined]


def longest_draft(chances: dict[int, list[float]], outputs: int, rows: int, most: int, last: int,
                  cost: Callable[[int], float]) -> int:
    """``WidthCosts.choose`` for a fixed k: the step's longest draft (at most ``most``)."""
    return min(max((len(c) for c in chances.values()), default=0), most)


@dataclass
class Outcome:
    """One run of all the prompts."""

    wall_s: float
    tokens: int
    steps: int
    decode_steps: int
    decode_s: float
    decode_tokens: int
    sampled: int
    sampling_steps: int
    verified: Verified
    outputs: dict[int, np.ndarray]
    in_graph: int  # sequences sampled in the decode graph


def drive(engine: RecordingEngine, prompts: list[list[int]], p: SamplingParams, proposer: Proposer | None) -> Outcome:
    """All prompts submitted at once (the engine runs ``slots`` of them at a time, the others wait), run
    to the end. A step is a decode step when no prompt is waiting or being computed before it."""
    engine.outputs.clear()
    engine.in_graph.clear()
    engine.spec.proposer = PromptLookup() if proposer is None else proposer
    c0 = (engine.sampled_tokens, engine.sampling_steps, engine.steps)
    steps = decode_steps = decode_tokens = tokens = 0
    decode_s = 0.0
    with counting() as v:
        t0 = time.perf_counter()
        for rid, prompt in enumerate(prompts):
            out = Step()
            engine.submit(Run(rid, prompt, p, False), out)
            if out.failed:
                raise RuntimeError(out.failed)
        while engine.busy:
            decoding = not engine.waiting and not any(s.prefilling for s in engine.active.values())
            s0, t1 = engine.sampled_tokens, time.perf_counter()
            step = engine.step()
            dt = time.perf_counter() - t1
            if step.failed:
                raise RuntimeError(step.failed)
            tokens += sum(d.completion_tokens for d in step.done)
            steps += 1
            if decoding:
                decode_steps += 1
                decode_s += dt
                decode_tokens += engine.sampled_tokens - s0
        wall = time.perf_counter() - t0
    engine.spec.proposer = PromptLookup()
    return Outcome(wall, tokens, engine.steps - c0[2], decode_steps, decode_s, decode_tokens,
                   engine.sampled_tokens - c0[0], engine.sampling_steps - c0[1], v, dict(engine.outputs),
                   sum(engine.in_graph.values()))


def compare(ref: dict[int, np.ndarray], got: dict[int, np.ndarray]) -> tuple[int, float]:
    """(sequences whose output differs from ``ref``'s, share of tokens before each one's first difference)."""
    bad, agree, total = 0, 0, 0
    for rid, r in ref.items():
        g = got.get(rid, np.zeros(0, np.int32))
        n = min(len(r), len(g))
        diff = np.flatnonzero(r[:n] != g[:n])
        same = int(diff[0]) if diff.size else n
        bad += same < len(r) or len(g) != len(r)
        agree += same
        total += len(r)
    return bad, agree / max(total, 1)


def row_of(case: Case, runs: list[Outcome], ref: dict[int, np.ndarray], n_seqs: int) -> dict[str, Any]:
    """The case's figures: the median run by tok/s (its counters are the run's own)."""
    tok_s = [o.tokens / o.wall_s for o in runs]
    o = sorted(runs, key=lambda o: o.tokens / o.wall_s)[len(runs) // 2]
    v = o.verified
    bad, agree = compare(ref, o.outputs)
    alpha = v.alpha
    return {
        "mode": case.mode, "k": case.k, "target_alpha": case.alpha,
        "alpha": None if alpha is None else round(alpha, 3),
        "acceptance": round(v.accepted / v.drafted, 3) if v.drafted else None,
        "drafted": v.drafted, "accepted": v.accepted,
        "drafts_per_seq_step": round(v.drafted / max(o.sampling_steps, 1), 2),
        "draft_lengths": dict(sorted(v.lengths.items())),
        "tokens_per_step": round(o.sampled / max(o.sampling_steps, 1), 2),
        "steps": o.steps, "ms_per_step": round(1e3 * o.decode_s / max(o.decode_steps, 1), 3),
        "decode_tok_s": round(o.decode_tokens / o.decode_s, 1) if o.decode_s else None,
        "tok_s": round(o.tokens / o.wall_s, 1), "tok_s_runs": [round(x, 1) for x in tok_s],
        "wall_s": round(o.wall_s, 3), "tokens": o.tokens,
        "sampled": "graph" if o.in_graph == n_seqs else "host" if o.in_graph == 0 else f"graph {o.in_graph}/{n_seqs}",
        "mismatched_seqs": bad, "agree": round(agree, 4),
    }


def default_cases(ks: list[int | str], alphas: list[float], random_drafts: bool, no_drafts: bool) -> list[Case]:
    cases = [Case("oracle", k, a) for a in alphas for k in ks]
    if random_drafts:
        cases.append(Case("random", BUDGET, 0.0))
    if no_drafts:
        cases.append(Case("no-draft", None))
    return cases


def run_case(engine: RecordingEngine, prompts: list[list[int]], gen: int, case: Case, proposer: Proposer | None
             ) -> Outcome:
    """One run of all the prompts as ``case`` says (off: ``speculative: false``; a fixed k: every step drafts
    k, :func:`every_step`; the budget: the engine's own choice, up to ``MAX_DRAFT``)."""
    p = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True,
                       speculative=False if case.mode == "off" else True if not isinstance(case.k, int) else case.k)
    if not isinstance(case.k, int):
        return drive(engine, prompts, p, proposer)
    with every_step(engine):
        return drive(engine, prompts, p, proposer)


def measure(engine: RecordingEngine, prompts: list[list[int]], gen: int, cases: list[Case], repeats: int = 1,
            seed: int = 0, emit: Callable[[dict[str, Any]], None] | None = None,
            deadline: float = math.inf, span: float = 0.0) -> list[dict[str, Any]]:
    """The off run (recording each prompt's greedy output), then each case, ``repeats`` rounds (each round:
    off, then every case, so slow drift hits all alike); one row per case (off first), figures of the
    median run, ``vs_off`` against off's median tok/s. Past ``deadline`` (``time.monotonic()``) no run
    starts: the cases not run have no row. ``span``: the oracle's right drafts come in runs (:func:`runs`)."""
    n_vocab, eog = engine.n_vocab, engine._eog
    # warm up (CUDA graphs, the cost model's first fit): a short off run and a short speculating one
    warm = prompts[: engine.cfg.slots]
    short = min(gen, 32)
    run_case(engine, warm, short, Case("off", None), None)
    pre = Oracle({i: len(q) for i, q in enumerate(warm)}, dict(engine.outputs), 1.0, n_vocab, eog, seed)
    run_case(engine, warm, short, Case("oracle", MAX_DRAFT, 1.0), Calls(pre))
    lengths = {i: len(q) for i, q in enumerate(prompts)}
    off = Case("off", None)
    runs: dict[Case, list[Outcome]] = {}
    ref: dict[int, np.ndarray] = {}
    oracles: dict[float, Oracle] = {}
    for r in range(repeats):
        if r and time.monotonic() > deadline:
            break
        o = run_case(engine, prompts, gen, off, None)
        if not ref:
            ref = o.outputs
            if sorted(ref) != list(range(len(prompts))) or any(len(t) != gen for t in ref.values()):
                raise RuntimeError("a sequence did not generate --gen tokens")
        runs.setdefault(off, []).append(o)
        for case in cases:
            if time.monotonic() > deadline:
                break
            proposer: Proposer = Calls(no_draft)
            if case.mode != "no-draft":
                alpha = 0.0 if case.alpha is None else case.alpha
                if alpha not in oracles:
                    oracles[alpha] = Oracle(lengths, ref, alpha, n_vocab, eog, seed, span)
                proposer = Calls(oracles[alpha])
            runs.setdefault(case, []).append(run_case(engine, prompts, gen, case, proposer))
        if emit is not None:
            emit({"mode": "progress", "round": r + 1, "of": repeats, "cases": sum(1 for c in cases if c in runs)})
    rows = [row_of(c, runs[c], ref, len(prompts)) for c in [off, *cases] if c in runs]
    for row in rows:
        row["vs_off"] = round(row["tok_s"] / rows[0]["tok_s"], 3)
    return rows


def make_prompts(n: int, length: int, n_vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    return [[int(t) for t in rng.integers(FIRST_ID, n_vocab, length)] for _ in range(n)]


def llama_server(binary: str, model: str, slots: int, ctx: int, prompts: list[list[int]], gen: int, repeats: int,
                 cpu: bool, threads: int, logs: Path) -> dict[str, Any]:
    """The peer on the same requests: B slots, B streams over its streaming ``/completion``; the median run."""
    from llamapool.bench.peer import LlamaServer

    logs.mkdir(parents=True, exist_ok=True)

    from llamapool.bench import drivers
    from llamapool.bench.workloads import Request, Workload

    work = Workload("oracle", tuple(Request(tuple(p), gen) for p in prompts), 0, ctx)
    warm = Workload("warm", tuple(Request(tuple(p), 8) for p in prompts[:slots]), 0, ctx)
    srv = LlamaServer(binary, model, slots, ctx, logs / f"llama-server-B{slots}.log", cpu, threads)
    try:
        srv.wait_healthy()
        target = drivers.Target("http-llama", srv.url)
        drivers.run(target, warm, slots)
        got = [drivers.run(target, work, slots, procs=1 if slots < 8 else 4) for _ in range(repeats)]
    finally:
        srv.stop()
    r = sorted(got, key=lambda r: r.tok_s)[len(got) // 2]
    return {"mode": "llama-server", "k": None, "tok_s": round(r.tok_s, 1),
            "tok_s_runs": [round(x.tok_s, 1) for x in got],
            "decode_tok_s": round(r.decode_tok_s, 1), "ms_per_step": round(r.itl_p50_ms, 3),
            "tokens_per_step": 1.0, "wall_s": round(r.wall_s, 3), "tokens": r.gen_tokens,
            "errors": sum(x.errors for x in got), "ttft_p50_ms": round(r.ttft_p50_ms, 1),
            "server_args": srv.args[1:]}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| B | mode | k | target alpha | alpha achieved | accepted / verified | drafts / seq-step | "
            "tokens / step | ms / step | decode tok/s | tok/s | vs off | vs llama-server | sampled | mismatched seqs |")
    lines = [head, "|" + "---|" * 15]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:,}" if isinstance(x, int | float) and not isinstance(x, bool) else str(x)

    for r in rows:
        if r.get("mode") in ("setup", "progress", "timing"):
            continue
        lines.append(f"| {r['B']} | {r['mode']} | {f(r.get('k'))} | {f(r.get('target_alpha'))} | {f(r.get('alpha'))} | "
                     f"{f(r.get('acceptance'))} | {f(r.get('drafts_per_seq_step'))} | {f(r.get('tokens_per_step'))} | "
                     f"{f(r.get('ms_per_step'))} | {f(r.get('decode_tok_s'))} | {f(r['tok_s'])} | "
                     f"{f(r.get('vs_off'))} | {f(r.get('vs_llama_server'))} | {f(r.get('sampled'))} | "
                     f"{f(r.get('mismatched_seqs'))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF (e.g. one written by `llamapool make-model`)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], metavar="B", help="concurrent sequences (slots)")
    ap.add_argument("--k", nargs="+", default=["3", "5", "7", BUDGET], metavar="K",
                    help=f"drafts every step (1 to {MAX_DRAFT}), or '{BUDGET}' (the step budget's choice)")
    ap.add_argument("--alpha", type=float, nargs="+", default=[1.0, 0.8, 0.7], metavar="A",
                    help="oracle acceptance: each draft token is the recorded one with this probability")
    ap.add_argument("--span", type=float, default=0.0, metavar="S",
                    help="the oracle's right drafts in runs of mean S tokens (0: each drawn alone)")
    ap.add_argument("--no-random", action="store_true", help="skip the random-drafts case (alpha 0, step budget)")
    ap.add_argument("--no-empty", action="store_true", help="skip the no-draft case (speculating, nothing drafted)")
    ap.add_argument("--prompt-tokens", type=int, default=128, metavar="P")
    ap.add_argument("--gen", type=int, default=128, metavar="G", help="tokens generated a prompt")
    ap.add_argument("--prompts", type=int, default=0, metavar="N",
                    help="prompts a run (default max(4, B); at least B)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds; each row gives the median run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="no GPU (n_gpu_layers 0)")
    ap.add_argument("--device", default="", metavar="N", help="CUDA_VISIBLE_DEVICES for this process (e.g. 0)")
    ap.add_argument("--no-gpu-sampling", action="store_true", help="GPU: sample every row on the host")
    ap.add_argument("--backend-sampling", action="store_true",
                    help="force llama.cpp's backend sampling (on a CPU: the GPU's sampling path)")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: its default; --cpu: 2)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--target-step", default="auto",
                    help="model.target_step (under 'auto' a decode step's token budget is its rows + 64: at 64 "
                         "streams the budget's drafts are at most 64 a step; fixed-k runs use 'off')")
    ap.add_argument("--llama-server", default="", metavar="PATH", help="the peer's binary (else skipped)")
    ap.add_argument("--peer-threads", type=int, default=8, help="llama-server -t")
    ap.add_argument("--stop-after", type=float, default=0.0, metavar="S",
                    help="start no run after S seconds (rows of what ran are still written; 0: no limit)")
    ap.add_argument("--out", default="", metavar="FILE", help="JSON lines appended here too (and FILE.md: the table)")
    ap.add_argument("--spec", nargs="*", default=[], metavar="NAME=VALUE",
                    help="a constant of worker/engine/spec.py set for this run (an experiment, e.g. SHRINK=0)")
    args = ap.parse_args()
    for item in args.spec:
        name, _, value = item.partition("=")
        if not hasattr(spec, name) or not name.isupper() or not value:
            ap.error(f"--spec: {item!r} names no constant of worker/engine/spec.py")
        setattr(spec, name, type(getattr(spec, name))(value))
    ks: list[int | str] = [k if k == BUDGET else int(k) for k in args.k]
    if any(k != BUDGET and not 1 <= int(k) <= MAX_DRAFT for k in ks):
        ap.error(f"--k: 1 to {MAX_DRAFT} or '{BUDGET}'")
    if any(not 0.0 <= a <= 1.0 for a in args.alpha):
        ap.error("--alpha: 0 to 1")
    out = Path(args.out) if args.out else None
    logs = Path(args.out + ".logs") if args.out else Path("/tmp/spec_oracle.logs")  # llama-server's
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic()
    deadline = t_start + args.stop_after if args.stop_after > 0 else math.inf

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        if out is not None:
            with open(out, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    gpu = not args.cpu
    threads = args.threads or (2 if args.cpu else 0)
    cases = default_cases(ks, args.alpha, not args.no_random, not args.no_empty)
    ctx = args.prompt_tokens + args.gen + MAX_DRAFT + 16
    setup: dict[str, Any] = {
        "mode": "setup", "model": Path(args.model).name, "gpus": visible_gpus() if gpu else [],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "P": args.prompt_tokens, "G": args.gen,
        "repeats": args.repeats, "ks": ks, "alphas": args.alpha, "max_batch_tokens": args.max_batch_tokens,
        "spec": args.spec, "span": args.span,
        "note": "llamapool rows: the engine in this process (no router or SDK hop); llama-server rows: over "
                "HTTP, tok/s = tokens / wall of the run, prompts included, both"}
    emit(setup)
    for b in args.batch:
        n = max(args.prompts or max(4, b), b)
        cfg = EngineConfig(args.model, slots=b, ctx_per_slot=ctx, max_batch_tokens=args.max_batch_tokens,
                           gpu=gpu, threads=threads, speculative="ngram", prefix_cache=False,
                           target_step=args.target_step,
                           gpu_sampling=not args.no_gpu_sampling,
                           backend_sampling=True if args.backend_sampling else None)
        t0 = time.monotonic()
        engine = RecordingEngine(cfg)
        prompts = make_prompts(n, args.prompt_tokens, engine.n_vocab, args.seed)
        emit({"mode": "engine", "B": b, "prompts": n, "desc": engine.desc, "gpu_sampling": engine.gpu_sampling,
              "target_step": str(engine.target), "load_s": round(time.monotonic() - t0, 1)})
        try:
            got = measure(engine, prompts, args.gen, cases, args.repeats, args.seed, emit, deadline, args.span)
        finally:
            engine.close()
        peer = None
        if args.llama_server and time.monotonic() > deadline:
            emit({"mode": "note", "B": b, "skipped": "llama-server: past --stop-after"})
        elif args.llama_server:
            peer = {**llama_server(args.llama_server, args.model, b, ctx, prompts, args.gen, args.repeats,
                                   args.cpu, args.peer_threads, logs), "B": b, "prompts": n}
        for row in got:
            row.update(B=b, prompts=n, model=Path(args.model).name, P=args.prompt_tokens, G=args.gen)
            if peer:
                row["vs_llama_server"] = round(row["tok_s"] / peer["tok_s"], 3)
            emit(row)
            rows.append(row)
        if peer:
            emit(peer)
            rows.append(peer)
        emit({"mode": "timing", "B": b, "s": round(time.monotonic() - t0, 1)})
    md = table(rows) + ("\n\nsampled: where each row's tokens were picked (graph: in the decode graph, drafts "
                        "and all; host: logits copied to the host)." if gpu and not args.no_gpu_sampling else "")
    print(md)
    if out is not None:
        Path(str(out) + ".md").write_text(md + "\n")
    bad = sum(r.get("mismatched_seqs") or 0 for r in rows)
    print(f"spec_oracle: {time.monotonic() - t_start:.0f} s; sequences whose greedy output differed from the off "
          f"run's: {bad}" + (" (near-ties: a batch of several rows of a sequence rounds otherwise)" if bad else ""))
    return 1 if any(r.get("errors") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
