"""A stand-in for llama-server's binary in ``llamapool bench --peer-server`` tests (there is no llama-server
build on the CPU test machines): it takes llama-server's arguments, writes them as JSON to
``$FAKE_LLAMA_SERVER_ARGS``, and serves ``GET /health`` and the streaming ``POST /completion`` (token
prompts; one event a token, then the final one with ``"stop": true``) on ``--host``/``--port``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from aiohttp import web


async def completion(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = int(body["n_predict"])
    for i in range(1, n + 1):
        await asyncio.sleep(0.001)
        ev = {"index": 0, "content": "a", "tokens": [7], "stop": False, "tokens_predicted": i}
        await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
    final = {"index": 0, "content": "", "stop": True, "tokens_predicted": n, "timings": {"cache_n": 0}}
    await resp.write(f"data: {json.dumps(final)}\n\n".encode())
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    known, _ = ap.parse_known_args()  # the others (-m, -np, -c, -ngl ...) are only recorded
    with open(os.environ["FAKE_LLAMA_SERVER_ARGS"], "w") as fh:
        json.dump(sys.argv[1:], fh)
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/completion", completion)
    web.run_app(app, host=known.host, port=known.port, print=None)


if __name__ == "__main__":
    main()
