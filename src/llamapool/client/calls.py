"""What the sync and async clients share: building requests and folding replies."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamapool.client.errors import BadRequestError, LlamapoolError, UnavailableError, from_reply
from llamapool.client.types import Completion, StreamChunk, Usage
from llamapool.protocol import codec
from llamapool.protocol.endpoints import ipc_path, needs_curve
from llamapool.protocol.messages import Chunk, Error, ErrorCode, Message, MetricsReply, Prompt, Result, StatusReply

DEFAULT_TIMEOUT = 300.0
PARAM_NAMES = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed",
               "stop", "ignore_eos")


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise BadRequestError(ErrorCode.INVALID_REQUEST, f"field 'timeout' must be > 0, got {timeout}",
                              "timeout")
    return timeout


def check_endpoint(endpoint: str) -> None:
    """Fail at once, rather than at the timeout, when an ipc:// endpoint has no socket file."""
    path = ipc_path(endpoint)
    if path is not None and not os.path.exists(path):
        raise UnavailableError(ErrorCode.UNAVAILABLE,
                               f"no llamapool daemon at {endpoint} (the socket file does not exist)")


KeySource = bytes | str | os.PathLike[str]


def curve_keys(endpoint: str, server_public_key: KeySource | None,
               client_key: KeySource | None) -> tuple[bytes, bytes, bytes] | None:
    """(server public, client public, client secret) for a CURVE connection, or None for a plain one.

    Keys are used on network (tcp://) endpoints only: an ipc:// socket is protected by its directory.
    A bad key file raises :class:`llamapool.security.KeyFileError` naming it.
    """
    if server_public_key is None and client_key is None:
        return None
    if server_public_key is None or client_key is None:
        raise ValueError("CURVE needs both server_public_key (the router's .pub) and client_key (your .key)")
    from llamapool import security

    server = security.public_key_of(server_public_key)
    public, secret = security.client_pair_of(client_key)
    if not needs_curve(endpoint):
        return None
    return server, public, secret


SEND_TIMEOUT = 5.0  # seconds a send may wait for a connection before the call fails


def send_timeout_ms(timeout: float | None) -> int:
    """SNDTIMEO for a call: a DEALER with no connection (no daemon, or a refused CURVE handshake)
    blocks on send; this bounds it (by the call's own timeout when that is shorter)."""
    return int(1000 * (SEND_TIMEOUT if timeout is None else min(SEND_TIMEOUT, timeout)))


def not_connected(endpoint: str) -> UnavailableError:
    return UnavailableError(ErrorCode.UNAVAILABLE, f"cannot send to {endpoint}: not connected (no daemon there, "
                            f"or it refused this client's CURVE handshake: check the client and server keys)")


def no_answer(endpoint: str, timeout: float) -> UnavailableError:
    return UnavailableError(ErrorCode.UNAVAILABLE, f"no answer from {endpoint} within {timeout:g}s: is the daemon "
                            f"running? (an ipc:// socket file left by a daemon that died, or a tcp:// router that "
                            f"refuses this client's CURVE key, also give no answer)")


def chat_prompt(messages: Sequence[Mapping[str, Any]]) -> Prompt:
    """Chat messages as the protocol's chat prompt (the daemon checks them and names a bad field)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} maps, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise BadRequestError(ErrorCode.INVALID_REQUEST, "'messages' must not be empty", "messages")
    return [dict(m) if isinstance(m, Mapping) else m for m in messages]


def new_id() -> str:
    return uuid.uuid4().hex


def generate_frame(rid: str, prompts: list[Prompt], batch: bool, stream: bool,
                   timeout: float | None, params: dict[str, Any], model: str | None = None) -> bytes:
    """Encode a generate request. Unknown parameter names are rejected here, early. ``model``: the
    pool's model to run it (None: the pool's first model)."""
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a string, got {type(model).__name__}")
    for k in params:
        if k not in PARAM_NAMES:
            raise TypeError(f"unknown generation parameter {k!r} (known: {', '.join(PARAM_NAMES)})")
    if not prompts:
        raise ValueError("no prompts given")
    # None means "the default" only where the protocol has no value for it
    sent = {k: v for k, v in params.items() if v is not None or k not in ("seed", "stop")}
    try:
        frame = codec.encode_generate(rid, prompts, batch, stream, timeout, sent, model)
    except (OverflowError, TypeError, ValueError) as e:  # ValueError: a lone surrogate in a string
        raise BadRequestError(ErrorCode.INVALID_REQUEST, f"request cannot be encoded: {e}") from None
    if len(frame) > codec.TRANSPORT_MAX_FRAME:  # the router would drop the connection, not answer
        raise BadRequestError(ErrorCode.TOO_LARGE, f"request is {len(frame)} bytes; the router takes at most "
                              f"{codec.TRANSPORT_MAX_FRAME} (and answers too_large above server.max_message_bytes)",
                              field="prompt")
    return frame


@dataclass
class Pending:
    """The replies of one request so far: ``feed`` each one, read ``done``/``results``."""

    n: int
    results: list[Completion | LlamapoolError | None] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * self.n
        self.remaining = self.n

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    def feed(self, msg: Message) -> StreamChunk | None:
        if isinstance(msg, Chunk):
            return StreamChunk(msg.text, msg.tokens, msg.index)
        if isinstance(msg, Result):
            self._set(msg.index, Completion(msg.text, msg.finish_reason,
                                            Usage(msg.prompt_tokens, msg.completion_tokens),
                                            msg.worker, msg.index, msg.model))
        elif isinstance(msg, Error):
            err = from_reply(msg)
            if msg.index is None:  # the whole request failed
                for i in range(self.n):
                    if self.results[i] is None:
                        self._set(i, err)
            else:
                self._set(msg.index, err)
        return None

    def _set(self, i: int, value: Completion | LlamapoolError) -> None:
        if 0 <= i < self.n and self.results[i] is None:
            self.results[i] = value
            self.remaining -= 1

    def completions(self) -> list[Completion]:
        """All completions in order; raise the first error."""
        out = []
        for r in self.results:
            if isinstance(r, LlamapoolError):
                raise r
            assert r is not None
            out.append(r)
        return out


def status_of(msg: Message) -> dict[str, Any]:
    """The ``status()`` answer of both clients, from the router's reply."""
    if not isinstance(msg, StatusReply):
        raise LlamapoolError("internal", f"unexpected reply {msg!r}")
    return {"models": msg.models, "workers": msg.workers, "queued": msg.queued, "running": msg.running,
            "draining": msg.draining, "gpus": msg.gpus}


def metrics_of(msg: Message) -> str:
    """The ``metrics()`` answer of both clients, from the router's reply."""
    if not isinstance(msg, MetricsReply):
        raise LlamapoolError("internal", f"unexpected reply {msg!r}")
    return msg.text


def decode_reply(frames: list[bytes]) -> Message:
    return codec.decode(frames, codec.REPLY_TYPES, 1 << 31)
