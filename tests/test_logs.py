"""Logs: one line per event, JSON with a request id from client to router to worker, the access
line, and journald priority prefixes (``<N>``) when stderr is the journal."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import zmq

from llamapool import log as logmod
from llamapool.protocol import codec
from llamapool.protocol.messages import Error, Generate, Result, Run, SamplingParams


def _ask(endpoint: str, rid: str, prompt: Any, stream: bool = True) -> Any:
    """Send one Generate with a request id of our choosing; return its final reply."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(codec.encode(Generate(rid, [prompt], SamplingParams(max_tokens=4, temperature=0.0), stream)))
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if s.poll(1000):
                msg = codec.decode(s.recv_multipart(), codec.REPLY_TYPES)
                if isinstance(msg, Result | Error):
                    return msg
        raise AssertionError(f"no final reply for {rid}")
    finally:
        s.close()




def test_json_logs_follow_a_request_id_from_router_to_worker(start_daemon) -> None:  # type: ignore[no-untyped-def]
    d = start_daemon(wait_workers=2, log={"format": "json", "level": "debug"})
    reply = _ask(d.endpoint, "req-json-1", "Once upon a time")
    assert isinstance(reply, Result) and reply.completion_tokens == 4
    d.wait_log('"req-json-1"', timeout=10.0)
    d.wait_log('"msg": "finished"', timeout=10.0)
    assert d.stop() == 0
    rows = []
    for line in d.log.read_text().splitlines():
        obj = json.loads(line)  # every line is one JSON object, native output included
        assert {"ts", "level", "component", "msg"} <= obj.keys(), obj
        rows.append(obj)
    mine = [r for r in rows if r.get("id") == "req-json-1"]
    by = {(r["component"], r["msg"]) for r in mine}
    assert ("router", "dispatch") in by and ("router", "access") in by, mine
    assert {(reply.worker, "started"), (reply.worker, "finished")} <= by, mine
    access = next(r for r in mine if r["msg"] == "access")
    assert access["level"] == "info" and access["outcome"] == "ok" and access["finish"] == "length"
    assert access["model"] == "tiny" and access["worker"] == reply.worker and access["tenant"] == "default"
    assert access["prompt_tokens"] == reply.prompt_tokens and access["generated_tokens"] == 4
    assert 0 < access["ttft_ms"] <= access["duration_ms"] and access["queue_ms"] <= access["ttft_ms"]
    assert any(r["component"] == "supervisor" and r["msg"].startswith("ready") for r in rows)


def test_text_logs_carry_journald_priorities_and_an_access_line(start_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With JOURNAL_STREAM naming stderr, every line starts with <N>; a worker's warning keeps <4>."""
    log = tmp_path / "d0" / "daemon.log"  # the file launch() will truncate and use as stderr
    log.parent.mkdir(parents=True)
    log.touch()
    st = os.stat(log)
    d = start_daemon(wait_workers=2, env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    ok = _ask(d.endpoint, "req-text-1", "Hello", stream=False)
    assert isinstance(ok, Result)
    too_long = _ask(d.endpoint, "req-text-2", [1] * 600)  # > ctx_per_slot=512: the worker refuses it
    assert isinstance(too_long, Error) and too_long.code == "context_length_exceeded"
    text = d.wait_log("id=req-text-2", timeout=10.0)
    from llamapool.client.errors import UnknownModelError

    with d.client() as c:  # refused before it was queued: still one access line
        try:
            c.generate("hi", model="nope", max_tokens=2)
        except UnknownModelError:
            pass
    d.wait_log("outcome=unknown_model", timeout=10.0)
    assert d.stop() == 0
    text = d.log.read_text()
    lines = text.splitlines()
    assert lines and all(ln[:1] == "<" and ln[2:3] == ">" for ln in lines), text
    assert any(ln.startswith("<6>llamapool: router: access id=req-text-1 model=tiny worker=cpu")
               and "outcome=ok finish=length" in ln and "ttft_ms=" not in ln for ln in lines), text
    assert any(ln.startswith("<6>llamapool: router: access id=req-text-2") and "outcome=context_length_exceeded" in ln
               for ln in lines), text
    assert any(ln.startswith("<4>[cpu") and "request failed: prompt has 600 tokens" in ln
               and "id=req-text-2" in ln for ln in lines), text
    assert any(ln.startswith("<6>llamapool: ready") for ln in lines), text
    assert any(ln.startswith("<6>llamapool: router: access id=")
               and "model=nope outcome=unknown_model tenant=default" in ln for ln in lines), text


def test_log_helpers() -> None:
    assert logmod.split_priority("<4>[cpu0] x") == (4, "[cpu0] x")
    assert logmod.split_priority("plain", 3) == (3, "plain")
    line = logmod.format_line(6, "router", "llamapool: router", "access", {"id": "a b", "n": 2, "x": None},
                              fmt="text")
    assert line == 'llamapool: router: access id="a b" n=2'
    obj = json.loads(logmod.format_line(4, "cpu0", "", "m", {"id": "r1"}, fmt="json"))
    assert obj["level"] == "warning" and obj["component"] == "cpu0" and obj["id"] == "r1"
    assert obj["ts"].endswith("Z")
    # a Run from an older router (no "req") still decodes
    d = codec.to_dict(Run(1, "p", SamplingParams(), False, "r"))
    del d["req"]
    import msgpack

    msg = codec.decode([msgpack.packb(d)], codec.ROUTER_TYPES)
    assert isinstance(msg, Run) and msg.req == ""


def test_a_childs_unprefixed_library_lines_keep_their_level(capsys) -> None:  # type: ignore[no-untyped-def]
    """uvicorn writes ``ERROR: ...``/``WARNING: ...`` itself: the supervisor re-emits them at that level."""
    from llamapool.config import from_dict
    from llamapool.supervisor.arbiter import Supervisor, WorkerSlot

    sup = Supervisor(from_dict({"model": {"path": "/m.gguf"}, "log": {"format": "json"}}), use_nvml=False)
    slot = WorkerSlot("http0", (), None)
    logmod.configure("json", "info", env={})
    try:
        for raw in (b"ERROR:    Cancel 1 running task(s), timeout graceful shutdown exceeded",
                    b"WARNING:  Invalid HTTP request received.", b"INFO:     Started server process"):
            sup._child_line(slot, raw)
    finally:
        logmod.configure("text", "info")
    levels = [json.loads(ln)["level"] for ln in capsys.readouterr().err.splitlines()]
    assert levels == ["error", "warning", "info"]


def test_llama_cpp_pieces_become_lines_at_llamapool_levels(capsys) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp's callback pieces (a line in several calls, CONT continuing the level) become one JSON
    line each: errors as errors, warnings only at log.level debug (as warnings), its debug lines never."""
    from llamapool.worker import llamalog

    assert llamalog.worker_name(["-m", '{"name": "gpu3", "slots": 8}']) == "gpu3"
    assert llamalog.worker_name(["pytest", "-q"]) == "llama.cpp"
    rows = []
    for level in ("info", "debug"):
        logmod.configure("json", level, env={})
        try:
            out = llamalog.LlamaLog(logmod.Logger("cpu7", prefix="llamapool worker cpu7"))
            out.piece(llamalog.WARN, "load: control-looking token: 212 '</s>'")
            out.piece(llamalog.CONT, " was not control-type\n")
            out.piece(llamalog.INFO, "load_tensors: loading")
            out.piece(llamalog.CONT, "...")
            out.piece(llamalog.CONT, " done\n")
            out.piece(llamalog.DEBUG, "create_tensor: loading tensor blk.0.attn_q.weight\n")
            out.piece(llamalog.ERROR, "llama_model_load: error loading model\nsecond line\n")
        finally:
            logmod.configure("text", "info")
        rows.append([json.loads(ln) for ln in capsys.readouterr().err.splitlines()])
    assert [(r["level"], r["component"], r["msg"]) for r in rows[0]] == [
        ("error", "cpu7", "llama.cpp: llama_model_load: error loading model"),
        ("error", "cpu7", "llama.cpp: second line")]
    assert [(r["level"], r["msg"]) for r in rows[1]] == [
        ("warning", "llama.cpp: load: control-looking token: 212 '</s>' was not control-type"),
        ("debug", "llama.cpp: load_tensors: loading... done"),
        ("error", "llama.cpp: llama_model_load: error loading model"), ("error", "llama.cpp: second line")]


def test_a_default_start_shows_no_llama_cpp_loader_notes_debug_shows_them_per_worker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Gemma 3 270M's loader notes (a control-looking token, the full-size SWA cache) read like faults:
    not in a default start's log nor in status's log_tail; with log.level debug, warnings of the worker."""
    from pathlib import Path

    from llamapool import default_model
    from tests.conftest import launch

    gemma = str(default_model.fetch(Path(__file__).resolve().parent.parent / "models"))
    model = {"path": gemma, "ctx_per_slot": 256, "max_batch_tokens": 256, "n_ubatch": 256}
    quiet = launch(tmp_path / "quiet", gemma, model=model, workers={"cpu_workers": 1, "slots": 2})
    loud = launch(tmp_path / "loud", gemma, model=model, workers={"cpu_workers": 1, "slots": 2},
                  log={"format": "json", "level": "debug"})
    try:
        st = quiet.wait_ready(1)
        loud.wait_ready(1)
        loud.wait_log("using full-size SWA cache", timeout=10)
    finally:
        assert quiet.stop() == 0 and loud.stop() == 0
    text = quiet.log.read_text()
    assert "llama.cpp" not in text and "control-looking" not in text and "SWA" not in text, text
    assert not any("llama.cpp" in line for w in st["workers"] for line in w["log_tail"]), st["workers"]
    rows = [json.loads(ln) for ln in loud.log.read_text().splitlines()]
    notes = [r for r in rows if "control-looking token" in r["msg"] or "full-size SWA cache" in r["msg"]]
    assert notes and all(r["level"] == "warning" and r["component"] == "cpu0" and r["msg"].startswith("llama.cpp: ")
                         for r in notes), notes
