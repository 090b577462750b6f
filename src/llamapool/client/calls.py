"""What the sync and async clients share: building requests and folding replies."""

from __future__ import annotations

import array
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from llamapool.client.errors import BadRequestError, LlamapoolError, UnavailableError, from_reply
from llamapool.client.types import Completion, Embeddings, Reranking, RerankResult, StreamChunk, ToolCall, Usage
from llamapool.protocol import codec, params
from llamapool.protocol.endpoints import ipc_path, needs_curve
from llamapool.protocol.messages import (
    Chunk,
    Detokenize,
    DetokenizeReply,
    Embed,
    Embedding,
    Error,
    ErrorCode,
    Message,
    MetricsReply,
    ModelActionReply,
    Prompt,
    Rerank,
    Result,
    StatusReply,
    Tokenize,
    TokenizeReply,
)

DEFAULT_TIMEOUT = 300.0
R = TypeVar("R")
PARAM_NAMES = params.PARAM_NAMES  # the contract's names (protocol/params.py): the SDK's keywords
# a call's generation parameters: its keywords as given (the daemon checks them), or a SamplingParams
# built (and checked) once by the caller, passed as ``sampling=`` and sent as it is
Params = Mapping[str, Any] | params.SamplingParams


def given(keywords: dict[str, Any], sampling: params.SamplingParams | None) -> Params:
    """A call's parameters: its keywords, or ``sampling`` in their stead."""
    if sampling is None:
        return keywords
    if not isinstance(sampling, params.SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams (llamapool.protocol.params), got {type(sampling).__name__}")
    if keywords:
        raise TypeError(f"give the generation parameters as keywords or as sampling=, not both "
                        f"(got {', '.join(keywords)})")
    return sampling


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


def choices(given: Params, one: bool = False) -> int:
    """Replies per prompt: its ``n`` choices (the daemon checks ``n``; a bad one fails there, by name).
    ``one``: a call that returns one :class:`Completion` takes only ``n = 1``."""
    n = given.n if isinstance(given, params.SamplingParams) else given.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    if one and n > 1:
        raise TypeError(f"n={n}: this call returns one Completion; use generate_many([prompt], n={n}) (a prompt "
                        f"may be chat messages) or a stream, whose chunks carry each choice's index")
    return n


def new_id() -> str:
    return uuid.uuid4().hex


def generate_frame(rid: str, prompts: list[Prompt], batch: bool, stream: bool,
                   timeout: float | None, given: Params, model: str | None = None, tenant: str | None = None,
                   priority: str | None = None) -> bytes:
    """Encode a generate request. Unknown parameter names are rejected here, early. ``model``: the
    pool's model to run it (None: the pool's first model); ``tenant`` and ``priority``: who asks and
    the class asked for (the router checks both and trusts ``tenant``: docs/security.md)."""
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a string, got {type(model).__name__}")
    for name, v in (("tenant", tenant), ("priority", priority)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name} must be a string, got {type(v).__name__}")
    if isinstance(given, params.SamplingParams):
        sent = params.to_wire(given)
    else:
        for k in given:
            if k not in PARAM_NAMES:
                raise TypeError(f"unknown generation parameter {k!r} (known: {', '.join(PARAM_NAMES)})")
        # None means "the default" only where the protocol has no value for it
        sent = {k: v for k, v in given.items() if v is not None or k not in ("seed", "stop")}
    if not prompts:
        raise ValueError("no prompts given")
    try:
        frame = codec.encode_generate(rid, prompts, batch, stream, timeout, sent, model, tenant, priority)
    except (OverflowError, TypeError, ValueError) as e:  # ValueError: a lone surrogate in a string
        where = codec.unencodable(prompts if batch else prompts[0], "prompts" if batch else "prompt") or \
            codec.unencodable(sent, "params") or codec.unencodable(model, "model")
        raise _unencodable(where, e) from None
    if len(frame) > codec.TRANSPORT_MAX_FRAME:  # the router would drop the connection, not answer
        raise BadRequestError(ErrorCode.TOO_LARGE, f"request is {len(frame)} bytes; the router takes at most "
                              f"{codec.TRANSPORT_MAX_FRAME} (and answers too_large above server.max_message_bytes)",
                              field="prompt")
    return frame


def _unencodable(where: tuple[str, str] | None, e: Exception) -> BadRequestError:
    """The error for a request the codec cannot encode, naming the field (``prompt[3]``,
    ``params.stop[0]``, ``messages[1].content``) when it can be found."""
    if where is None:
        return BadRequestError(ErrorCode.INVALID_REQUEST, f"request cannot be encoded: {e}")
    field = where[0].lstrip(".")
    return BadRequestError(ErrorCode.INVALID_REQUEST, f"'{field}' {where[1]}", field)


@dataclass
class Replies(Generic[R]):
    """The final replies of one request so far, ``n`` of them in index order: ``done``, ``results``."""

    n: int
    results: list[R | LlamapoolError | None] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * self.n
        self.remaining = self.n

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    def _set(self, i: int, value: R | LlamapoolError) -> None:
        if 0 <= i < self.n and self.results[i] is None:
            self.results[i] = value
            self.remaining -= 1

    def _fail(self, msg: Error) -> None:
        """An error reply: its prompt's (or, without an index, every prompt's still open)."""
        err = from_reply(msg)
        for i in range(self.n) if msg.index is None else (msg.index,):
            self._set(i, err)

    def ordered(self) -> list[R]:
        """Every reply in order; raise the first error."""
        out = []
        for r in self.results:
            if isinstance(r, LlamapoolError):
                raise r
            assert r is not None
            out.append(r)
        return out


@dataclass
class Pending(Replies[Completion]):
    """The replies of one generate request so far: ``feed`` each one, read ``done``/``results``."""

    def feed(self, msg: Message) -> StreamChunk | None:
        if isinstance(msg, Chunk):
            return StreamChunk(msg.text, msg.tokens, msg.index, msg.logprobs, msg.prompt_tokens, msg.cached_tokens,
                               msg.ratelimit)
        if isinstance(msg, Result):
            self._set(msg.index, Completion(msg.text, msg.finish_reason,
                                            Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens),
                                            msg.worker, msg.index, msg.model,
                                            [ToolCall(**c) for c in msg.tool_calls or ()], msg.stop,
                                            msg.logprobs, msg.ratelimit))
        elif isinstance(msg, Error):
            self._fail(msg)
        return None

    def completions(self) -> list[Completion]:
        """All completions in order; raise the first error."""
        return self.ordered()


def status_of(msg: Message) -> dict[str, Any]:
    """The ``status()`` answer of both clients, from the router's reply."""
    if not isinstance(msg, StatusReply):
        raise LlamapoolError("internal", f"unexpected reply {msg!r}")
    return {"models": msg.models, "workers": msg.workers, "queued": msg.queued, "running": msg.running,
            "draining": msg.draining, "gpus": msg.gpus}


def model_action_of(msg: Message) -> dict[str, Any]:
    """The answer of ``load_model``, ``unload_model``, ``pin_model`` and ``unpin_model`` of both clients:
    the model, the action, its state after it and a sentence; an :class:`Error` raises."""
    if isinstance(msg, Error):
        raise from_reply(msg)
    if not isinstance(msg, ModelActionReply):
        raise LlamapoolError("internal", f"unexpected reply {msg!r}")
    return {"model": msg.model, "action": msg.action, "state": msg.state, "message": msg.message}


def metrics_of(msg: Message) -> str:
    """The ``metrics()`` answer of both clients, from the router's reply."""
    if not isinstance(msg, MetricsReply):
        raise LlamapoolError("internal", f"unexpected reply {msg!r}")
    return msg.text


def decode_reply(frames: list[bytes]) -> Message:
    return codec.decode(frames, codec.REPLY_TYPES, 1 << 31)


EmbedInputs = str | Sequence[int] | Sequence[str | Sequence[int]]


def embed_inputs(inputs: EmbedInputs) -> list[str | list[int]]:
    """``embed``'s inputs as the protocol's list: a text, a list of token ids, or a list of them (the
    daemon checks each and names a bad one, ``input[3]``)."""
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, Sequence) and not isinstance(inputs, (bytes, bytearray)):
        if not inputs:
            raise BadRequestError(ErrorCode.INVALID_REQUEST, "'input' must not be empty", "input")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
            return [list(inputs)]  # type: ignore[arg-type]
        return [x if isinstance(x, str) or not isinstance(x, Sequence) else list(x)  # type: ignore[misc, arg-type]
                for x in inputs]
    raise TypeError(f"inputs must be a string, a list of token ids, or a list of them, got {type(inputs).__name__}")


def rerank_documents(documents: Any) -> list[str]:
    """``rerank``'s documents as the protocol's list: a non-empty list of texts."""
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence) or not documents:
        raise BadRequestError(ErrorCode.INVALID_REQUEST, "'documents' must be a non-empty list of strings",
                              "documents")
    bad = next((i for i, d in enumerate(documents) if not isinstance(d, str)), None)
    if bad is not None:
        raise BadRequestError(ErrorCode.INVALID_REQUEST, f"'documents[{bad}]' must be a string, got "
                              f"{type(documents[bad]).__name__}", f"documents[{bad}]")
    return list(documents)


def rerank_top_n(top_n: int | None, n_documents: int) -> int:
    """How many of the sorted results ``rerank`` returns: ``top_n`` (an integer >= 1; more than the
    documents returns them all, as Jina, Cohere and llama-server do), None: all of them."""
    if top_n is None:
        return n_documents
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise BadRequestError(ErrorCode.INVALID_REQUEST, f"'top_n' must be an integer >= 1, got {top_n!r}", "top_n")
    return min(top_n, n_documents)


def task_frame(msg: Embed | Rerank | Tokenize | Detokenize) -> bytes:
    """Encode an embed, rerank, tokenize or detokenize request (the router checks its fields and names a bad one)."""
    if msg.model is not None and not isinstance(msg.model, str):
        raise TypeError(f"model must be a string, got {type(msg.model).__name__}")
    try:
        frame = codec.encode(msg)
    except (OverflowError, TypeError, ValueError) as e:
        raise _unencodable(codec.unencodable(codec.to_dict(msg), ""), e) from None
    if len(frame) > codec.TRANSPORT_MAX_FRAME:
        raise BadRequestError(ErrorCode.TOO_LARGE, f"request is {len(frame)} bytes; the router takes at most "
                              f"{codec.TRANSPORT_MAX_FRAME}", field="input")
    return frame


TaskReply = Embedding | TokenizeReply | DetokenizeReply


@dataclass
class TaskPending(Replies[TaskReply]):
    """The final replies of an embed (one per input), a tokenize or a detokenize: ``feed`` each one."""

    def feed(self, msg: Message) -> None:
        if isinstance(msg, (Embedding, TokenizeReply, DetokenizeReply)):
            self._set(msg.index if isinstance(msg, Embedding) else 0, msg)
        elif isinstance(msg, Result):  # cancelled (the SDK cancels only when it stops waiting)
            self._set(msg.index, LlamapoolError(ErrorCode.INTERNAL, f"request {msg.finish_reason}"))
        elif isinstance(msg, Error):
            self._fail(msg)

    def replies(self) -> list[TaskReply]:
        """Every reply in order; raise the first error."""
        return self.ordered()

    def reranking(self, documents: Sequence[str], top_n: int) -> Reranking:
        """The documents' scores, sorted (highest first), the first ``top_n``."""
        replies = [r for r in self.replies() if isinstance(r, Embedding)]
        scores = [array.array("f", r.embedding)[0] for r in replies]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        return Reranking([RerankResult(i, float(scores[i]), documents[i]) for i in order[:top_n]],
                         sum(r.prompt_tokens for r in replies), replies[0].model if replies else "")

    def embeddings(self) -> Embeddings:
        replies = [r for r in self.replies() if isinstance(r, Embedding)]
        return Embeddings([r.embedding for r in replies], sum(r.prompt_tokens for r in replies),
                          replies[0].model if replies else "")

    def tokens(self) -> list[Any]:
        r = self.replies()[0]
        assert isinstance(r, TokenizeReply)
        return r.tokens

    def text(self) -> str:
        r = self.replies()[0]
        assert isinstance(r, DetokenizeReply)
        return r.content
