"""Crash isolation: one request's failure ends that request, never its worker or the other requests; a
request that kills its worker is not sent to worker after worker (issue 29, item 7).

Faults are injected per request with ``LLAMAPOOL_INJECT_FAULT`` (worker/faults.py), through the
config's ``[workers] env``: ``raise=MARK`` raises in the emit path of a request whose prompt holds MARK,
``exit=MARK`` ends its worker process there.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import msgpack
import pytest
import zmq

from llamapool import InternalError
from llamapool.worker.faults import ENV, FaultInjector
from llamapool.worker.tools import ToolFormat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


# ------------------------------------------------------------ the tool-call parser takes any JSON

HOSTILE = [
    '{"name": {"first": "Ann"}}',  # issue 29's: a name that is an object (unhashable)
    '{"name": {"first": "Ann"}, "arguments": {}}',
    '{"name": ["get_weather"], "arguments": {}}',  # a list
    '{"name": 3, "arguments": {}}',
    '{"name": null, "parameters": {}}',
    '{"name": "get_weather", "arguments": "{\\"city\\": 1}"}',  # arguments as text: not a call
    '{"name": "get_weather", "arguments": [1, 2]}',
    '{"name": "get_weather", "arguments": {"city": "Par',  # truncated
    '<tool_call>\n{"name": "get_weather", "arguments": {"a": ' + "[" * 5000,  # deeper than the recursion limit
    "[" * 100_000,
    "{" * 20_000,
    '{"name": "get_weather", "arguments": {"n": ' + "9" * 5000 + "}}",  # more digits than int() takes
    '[TOOL_CALLS][{"name": {"x": 1}, "arguments": {}}, 7, "s"]',
    '{"name": "get_weather", "arguments": {"a": ' + "[" * 990 + "]" * 990 + "}}",  # decodes; may not re-encode
]


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral", "generic"])
@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_the_parser_takes_any_json_a_model_may_write(family: str, text: str) -> None:
    content, calls = ToolFormat(family).parse(text, TOOLS)
    for c in calls:  # anything it does take is a well-formed call of a given tool
        assert c["name"] == "get_weather" and isinstance(json.loads(c["arguments"]), dict)
    if not calls:
        assert content == text


def test_a_call_among_hostile_json_is_still_found() -> None:
    text = 'x {"name": {"first": "Ann"}} {"name": "get_weather", "arguments": {"city": "Paris"}}'
    content, calls = ToolFormat("hermes").parse(text, TOOLS)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert content == 'x {"name": {"first": "Ann"}}'


def test_the_fault_spec_is_checked() -> None:
    assert FaultInjector.from_env({}) is None
    f = FaultInjector.from_env({ENV: "raise=BOOM;exit=DIE"})
    assert f is not None
    assert (f.kind("a BOOM b"), f.kind([{"role": "user", "content": "DIE"}]), f.kind([1, 2]), f.kind("ok")) == \
        ("raise", "exit", "", "")
    with pytest.raises(ValueError, match=ENV):
        FaultInjector.from_env({ENV: "explode=X"})


# ------------------------------------------------------------ a real daemon


def _stream(d: Any, prompt: str, out: dict[str, Any], **params: Any) -> None:
    try:
        with d.client() as c:
            out[prompt] = "".join(ch.text for ch in c.stream(prompt, timeout=60, **params)), None
    except Exception as e:  # judged by the test
        out[prompt] = None, e


def test_a_request_that_raises_ends_alone_and_the_worker_goes_on(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(wait_workers=1, workers={"cpu_workers": 1, "slots": 4, "env": {ENV: "raise=POISON"}})
    pid = d.status()["workers"][0]["pid"]
    params = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    out: dict[str, Any] = {}
    prompts = ["good one", "good two", "POISON pill", "good three"]
    threads = [threading.Thread(target=_stream, args=(d, p, out), kwargs=params) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    text, err = out["POISON pill"]
    assert isinstance(err, InternalError), out["POISON pill"]
    assert "InjectedFault" in err.message and "faults.py" in err.message and "other requests go on" in err.message
    with d.client() as c:
        alone = c.generate("good one", **params).text
    for p in ("good one", "good two", "good three"):
        text, err = out[p]
        assert err is None, (p, err)
        assert c is not None and len(text) > 0
    assert out["good one"][0] == alone, "the neighbour's failure changed nothing in this one's text"
    row = d.status()["workers"][0]
    assert (row["pid"], row["state"]) == (pid, "ready")
    assert "FATAL" not in d.log.read_text(errors="replace")


def _send_raw(endpoint: str, rid: str, prompt: str, timeout: float = 60.0) -> dict[str, Any]:
    """A generate on a raw socket with the request id ``rid``; its final reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(msgpack.packb({"v": 1, "type": "generate", "id": rid, "prompt": prompt, "stream": True,
                             "params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}}))
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if sock.poll(100):
                msg = msgpack.unpackb(sock.recv())
                if msg["type"] != "chunk":
                    return msg  # type: ignore[no-any-return]
        raise AssertionError(f"no final reply for {rid} in {timeout}s")
    finally:
        ctx.destroy(linger=0)


def test_a_request_that_kills_its_worker_twice_ends_with_worker_lost(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(workers={"env": {ENV: "exit=KILLER"}})
    t0 = time.monotonic()
    reply = _send_raw(d.endpoint, "poison-7", "the KILLER request")
    took = time.monotonic() - t0
    assert reply["type"] == "error" and reply["code"] == "worker_lost", reply
    assert "request poison-7 was running on 2 workers that were lost" in reply["message"]
    assert reply.get("tokens_delivered", 0) == 0
    log = d.log.read_text(errors="replace")
    assert log.count("lost (exit code 70)") == 2, "sent to a second worker once, then not again"
    d.wait_ready(2, timeout=60)  # the model stays available: both workers restarted
    with d.client() as c:
        assert c.generate("still here", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
    assert took < 15, f"the poison pill took {took:.1f}s to be refused"


def test_the_issue_reproduction_tool_mode_reply_with_an_object_name(start_daemon) -> None:  # type: ignore[no-untyped-def]
    """Issue 29's crash: tools (auto) and a reply holding ``{"name": {"first": "Ann"}}`` (here the echoed
    prompt puts it in the reply's text, as SmolLM2 wrote it): a reply, and no worker restarted."""
    d = start_daemon()
    pids = {w["id"]: w["pid"] for w in d.status()["workers"]}
    msgs = [{"role": "user", "content": 'Who? {"name": {"first": "Ann"}, "arguments": {}}'}]
    with d.client() as c:
        for _ in range(2):
            r = c.generate(msgs, tools=TOOLS, echo=True, max_tokens=4, temperature=0, timeout=30)
            assert r.finish_reason == "length"  # (the echoed tool listing parses as a call: its text is cut there)
    assert {w["id"]: w["pid"] for w in d.status()["workers"]} == pids


def test_the_issue_reproduction_on_smollm2(tmp_path, smollm2: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 29's reproduction as found: SmolLM2-135M-Instruct with tools (auto) and a three-turn chat
    whose earlier assistant turns are JSON with an object ``name``; it answers in kind. Before: the
    parser raised, each worker died in turn (6 deaths in 30 s) and the client got ``unavailable``."""
    from tests.conftest import launch

    d = launch(tmp_path / "smol", smollm2, model={"path": smollm2, "ctx_per_slot": 1024},
               workers={"cpu_workers": 1})
    try:
        d.wait_ready(1, timeout=120)
        pid = d.status()["workers"][0]["pid"]
        tools = [{"type": "function", "function": {"name": "extract_person", "parameters": {
            "type": "object", "properties": {"name": {"type": "object"}}}}}]
        msgs: list[dict[str, Any]] = []
        for who, job in (("Ann Lee", "doctor"), ("Bob Stone", "pilot")):
            first, last = who.split()
            msgs += [{"role": "user", "content": f"Extract the person: {who} is a {job}."},
                     {"role": "assistant", "content": json.dumps({"name": {"first": first, "last": last}})}]
        msgs.append({"role": "user", "content": "Extract the person: Carl Fox is a cook."})
        with d.client() as c:
            r = c.chat(msgs, tools=tools, max_tokens=40, temperature=0, timeout=120)
        assert '{"name": {"first": "Carl"' in r.text and r.finish_reason == "stop", r
        assert d.status()["workers"][0]["pid"] == pid
        assert "FATAL" not in d.log.read_text(errors="replace")
    finally:
        d.stop()


@pytest.mark.parametrize("graph", ["", "always", "on_refusal"])
def test_a_mask_that_cannot_be_filled_fails_its_request_alone(model_path: str, monkeypatch: pytest.MonkeyPatch,
                                                              graph: str) -> None:
    """llguidance's batch fill raising (a matcher's bug) used to leave the engine's step: the worker died.
    Each row is then filled alone, and the row that raises fails its request (``internal``, naming the
    exception); the other constrained request and the plain one finish, and the engine goes on. So too
    where the decode graph applies the masks (``graph``: backend sampling, the failed row's stale mask
    uploaded; or applied only to a refused pick's row)."""
    import dataclasses

    import llguidance.numpy as lln

    from llamapool.protocol.messages import Run, SamplingParams, Step
    from llamapool.worker.engine import Engine, EngineConfig

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    p = SamplingParams(max_tokens=16, temperature=0.0, json_schema=schema)
    engine = Engine(EngineConfig(model_path, slots=3, ctx_per_slot=256, threads=2,
                                 **({"backend_sampling": True} if graph else {})))  # type: ignore[arg-type]
    if graph:
        engine.sampling.graph_masks = graph
    try:
        bad: list[Any] = []  # the matcher that raises: the first request's
        one, par = lln.fill_next_token_bitmask, lln.fill_next_token_bitmask_par

        def fill_one(matcher: Any, bits: Any, index: int = 0) -> None:
            if matcher in bad:
                raise RuntimeError("a matcher that cannot fill its mask")
            one(matcher, bits, index)

        def fill_par(executor: Any, rows: list[Any], bits: Any) -> None:
            if any(m in bad for m, _ in rows):
                raise RuntimeError("the batch fill failed")
            par(executor, rows, bits)

        monkeypatch.setattr(lln, "fill_next_token_bitmask", fill_one)
        monkeypatch.setattr(lln, "fill_next_token_bitmask_par", fill_par)
        runs = [Run(1, "x", p, False), Run(2, "y", p, False),
                Run(3, "z", dataclasses.replace(p, json_schema=None, ignore_eos=True), False)]
        for r in runs:
            engine.submit(r, Step())
        done, failed = {}, {}
        while engine.busy:
            step = engine.step()
            if not bad:  # the first request's matcher fails from its next mask on (once it runs: its grammar
                bad.extend(s.matcher for s in engine.sampling.states.values()  # compiles meanwhile)
                           if s.matcher is not None and engine.active[s.slot].rid == 1)
            done.update((d.rid, d) for d in step.done)
            failed.update((f.rid, f) for f in step.failed)
        assert set(failed) == {1} and set(done) == {2, 3}, (failed, done)
        assert "a matcher that cannot fill its mask" in failed[1].message
        assert json.loads(done[2].text) is not None and done[3].completion_tokens == 16
        if graph:  # the masks were applied in the graph
            assert engine.sampling._graph is not None and engine.sampling._graph.masked_inputs > 0
            assert engine.sampling.states == {} and engine.sampling._masked
        assert run_again(engine, p)  # the engine goes on
    finally:
        engine.close()


def run_again(engine: Any, p: Any) -> bool:
    from llamapool.protocol.messages import Run, Step

    engine.submit(Run(9, "again", p, False), Step())
    out = []
    while engine.busy:
        out += engine.step().done
    return bool(out) and json.loads(out[0].text) is not None
