"""A gateway process: ``python -m llamapool.gateway SPEC_JSON`` (started by the supervisor).

It accepts on the listening socket it inherits from the supervisor (descriptor ``listen_fd``), which
every gateway process shares (``supervisor/listener.py``): it never binds one. SIGTERM stops accepting
(the others, and a reload's new ones, go on taking connections from the socket's queue) and lets the
requests in flight finish (up to ``drain_timeout``), then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys

from llamapool import lifeline
from llamapool.gateway import GatewaySpec

# A request's replies the gateway has not yet handled. Its handlers are never held back by a slow HTTP
# client (gateway/connections.py), so this fills only when the process cannot keep up with the
# router: past it the request is cancelled (an error event ends its stream) rather than hold memory.
QUEUED_REPLIES = 2048


def inherited(fd: int) -> socket.socket:
    """The supervisor's listening socket at descriptor ``fd``; OSError when it is not one."""
    sock = socket.socket(fileno=fd)
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise OSError(f"descriptor {fd} is not a listening TCP socket")
    return sock


async def serve(spec: GatewaySpec) -> int:
    import uvicorn

    from llamapool.client.aio import AsyncClient
    from llamapool.gateway.app import Gateway
    from llamapool.gateway.connections import ConnectionLimits, Tracker, protocol_class
    from llamapool.log import Logger
    from llamapool.rlimits import raise_fd_limit

    log = Logger(spec.name, prefix=f"llamapool gateway {spec.name}")
    fd_limit = raise_fd_limit()
    limits, warning = ConnectionLimits(spec.idle_timeout, spec.read_timeout, spec.max_connections,
                                       spec.send_timeout, spec.send_buffer_bytes).resolved(fd_limit)
    if warning:
        log.warning(warning)
    try:
        sock = inherited(spec.listen_fd)
    except OSError as e:
        log.error(f"FATAL: no listening socket from the supervisor: {e}")
        return 78
    curve = bool(spec.server_key)  # a tcp:// frontend with CURVE: the supervisor's internal key
    # one client for the process, closed on the way out whatever happens (a request still running on the
    # daemon after the drain is cancelled there)
    async with AsyncClient(spec.frontend, timeout=spec.request_timeout, max_queued=QUEUED_REPLIES,
                           server_public_key=spec.server_key.encode() if curve else None,
                           client_key=spec.key_file if curve else None) as client:
        gateway = Gateway(spec, client)
        gateway.pod.start()  # the probes' and /metrics' snapshot of the router (gateway/pod.py)
        http = protocol_class(Tracker(limits, log.warning))  # uvicorn's httptools protocol, guarded
        config = uvicorn.Config(gateway.app(), loop="none", http=http, lifespan="off",
                                access_log=False, log_level="warning",
                                timeout_keep_alive=max(1, round(spec.idle_timeout)),
                                timeout_graceful_shutdown=max(1, round(spec.drain_timeout)))
        server = uvicorn.Server(config)
        log.info(f"listening on http://{spec.host}:{spec.port} (at most {limits.max_connections} connections; "
                 f"fd limit {fd_limit})")
        lifeline.report("listening")
        watch = asyncio.create_task(_exit_with_supervisor(spec.name))
        try:
            await server.serve(sockets=[sock])
        finally:
            watch.cancel()
            await gateway.pod.stop()
            if gateway.responses is not None:
                gateway.responses.close()
    return 0


async def _exit_with_supervisor(name: str) -> None:
    """The gateway runs in its own session, so it would outlive a supervisor killed with SIGKILL,
    holding the listening socket (and accepting connections) in front of a dead router.
    Like a worker, it exits when its parent changes."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            with contextlib.suppress(OSError):  # stderr was a pipe to the supervisor
                print(f"llamapool gateway {name}: supervisor gone, exiting", file=sys.stderr, flush=True)
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m llamapool.gateway SPEC_JSON", file=sys.stderr)
        return 2
    import uvloop

    from llamapool.lifeline import die_with_parent

    die_with_parent()
    return uvloop.run(serve(GatewaySpec.from_json(args[0])))


if __name__ == "__main__":
    sys.exit(main())
