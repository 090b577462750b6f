"""Typed messages of the llamapool wire protocol (see docs/protocol.md).

Every message is one msgpack map carrying ``v`` (the protocol version) and ``type``.
Client <-> router messages live on the frontend socket, router <-> worker messages on
the backend socket; both use the same codec (``llamapool.protocol.codec``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from llamapool.protocol.params import SamplingParams

PROTOCOL_VERSION = 1

ChatMessage = dict[str, Any]  # {"role": ..., "content": ...} (and tool_calls, tool_call_id, name)
Prompt = str | list[int] | list[ChatMessage]  # text, token ids, or chat messages


class ErrorCode:
    """Error codes carried by :class:`Error` replies."""

    MALFORMED = "malformed"  # not msgpack, not a map, or not one frame
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_REQUEST = "invalid_request"  # a field is missing, of the wrong type or out of range
    TOO_LARGE = "too_large"
    DUPLICATE_ID = "duplicate_id"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    WORKER_LOST = "worker_lost"
    INTERNAL = "internal"
    NO_CHAT_TEMPLATE = "no_chat_template"  # chat messages sent to a model without a chat template
    UNKNOWN_MODEL = "unknown_model"  # the request's ``model`` is not in the pool
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt has more tokens than a slot's context
    RATE_LIMITED = "rate_limited"  # the tenant's limits (keys file): concurrency, rpm, tpm, queue_share
    FORBIDDEN = "forbidden"  # the tenant may not ask for this (a priority class above its key's cap)


class TopLogprob(NamedTuple):
    """One of the likeliest tokens at a position: ``[token, logprob, bytes]`` on the wire."""

    token: str  # its text (bytes that are not UTF-8 replaced)
    logprob: float
    bytes: list[int]  # its bytes as the tokenizer has them


class TokenLogprob(NamedTuple):
    """A token's log-probability, made once by the worker's sampler and read by name by the API shapes:
    ``[token, logprob, bytes, top]`` on the wire (an array, like :class:`Delta`)."""

    token: str
    logprob: float | None  # None: a prompt's first token (``echo``), which nothing predicts
    bytes: list[int]
    top: list[TopLogprob]  # the ``top_logprobs`` likeliest tokens, likeliest first


# ---------------------------------------------------------------- client -> router


@dataclass(slots=True)
class Generate:
    """Generate for one prompt (``prompt``) or a micro-batch (``prompts``); replies carry ``index``."""

    TYPE: ClassVar[str] = "generate"
    id: str
    prompts: list[Prompt]
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    timeout: float | None = None
    batch: bool = False  # True when the client sent ``prompts`` rather than ``prompt``
    model: str | None = None  # the pool's model to run it; None -> the first model
    tenant: str | None = None  # who asks (the gateway: the API key's name); None -> the default tenant
    priority: str | None = None  # its class: "priority", "default" (None) or "flex" (docs/protocol.md)


EmbedInput = str | list[int]  # a text, or token ids used as given


@dataclass(slots=True)
class Embed:
    """Embed one input or several (``input`` on the wire); one ``embedding`` reply per input, by ``index``.
    Only a model configured with ``embedding = true`` answers it."""

    TYPE: ClassVar[str] = "embed"
    id: str
    inputs: list[EmbedInput]
    timeout: float | None = None
    model: str | None = None


@dataclass(slots=True)
class Rerank:
    """Score each document against ``query`` (a cross-encoder's relevance, llama.cpp's rank pooling); one
    ``embedding`` reply per document, by ``index``, whose vector is the score (one float32). Only a model
    configured with ``task = "rerank"`` answers it. ``max_tokens_per_doc`` (> 0) truncates each document
    to that many tokens; 0: a document is cut only where the pair would not fit a slot's context."""

    TYPE: ClassVar[str] = "rerank"
    id: str
    query: str
    documents: list[str]
    max_tokens_per_doc: int = 0
    timeout: float | None = None
    model: str | None = None


@dataclass(slots=True)
class Tokenize:
    """A text's tokens by the model's tokenizer (llama-server's ``/tokenize``); one ``tokenize_reply``."""

    TYPE: ClassVar[str] = "tokenize"
    id: str
    content: str
    add_special: bool = False  # add BOS (and EOS) as the model does
    parse_special: bool = True  # read special-token text such as <|im_start|> as those tokens
    with_pieces: bool = False  # each token as {"id", "piece"}
    timeout: float | None = None
    model: str | None = None
    # render (vLLM's /v1/completions/render, /v1/chat/completions/render): the tokens a generation of this
    # prompt puts in KV: ``content`` as a text prompt (BOS as the model wants, special text read as text), or
    # ``messages`` (and ``tools``) through the model's chat template; the flags above are then not used
    render: bool = False
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    # infill (``/infill``, ``suffix``): the fill-in-the-middle prompt's tokens, assembled by the worker from
    # ``input_prefix``, ``input_suffix`` (texts, or texts and token ids), ``input_extra`` ([filename, text]
    # pairs), ``prompt`` and ``n_predict`` (worker/infill.py); ``content`` and the flags are then not used
    infill: dict[str, Any] | None = None


@dataclass(slots=True)
class Detokenize:
    """Token ids to text (llama-server's ``/detokenize``); one ``detokenize_reply``."""

    TYPE: ClassVar[str] = "detokenize"
    id: str
    tokens: list[int]
    timeout: float | None = None
    model: str | None = None


@dataclass(slots=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    id: str


@dataclass(slots=True)
class StatusRequest:
    TYPE: ClassVar[str] = "status"
    id: str


@dataclass(slots=True)
class MetricsRequest:
    """Ask for the Prometheus exposition text (see docs/metrics.md)."""

    TYPE: ClassVar[str] = "metrics"
    id: str


MODEL_ACTIONS = ("load", "unload", "pin", "unpin")


@dataclass(slots=True)
class ModelAction:
    """An operator's command for one model of the pool: ``load`` (start a worker now), ``unload``
    (its workers finish what they run, then exit), ``pin`` (load it and never evict or idle-unload it),
    ``unpin``. Answered with :class:`ModelActionReply` (or an :class:`Error`)."""

    TYPE: ClassVar[str] = "model_action"
    id: str
    action: str
    model: str


@dataclass(slots=True)
class LoadAdapter:
    """An operator's LoRA adapter load at run time (SDK, CLI, HTTP): client -> router, which checks it and
    sends it on to each running worker of ``model`` (and to each worker of it that starts later); a worker
    answers with :class:`AdapterDone`, the client gets a :class:`ModelActionReply` once every worker loaded
    it, or an :class:`Error` naming the parameter. ``unload`` (a :class:`ModelAction`) takes it away."""

    TYPE: ClassVar[str] = "load_adapter"
    id: str
    name: str  # what requests name it by (as a model, or in ``lora``): unique among models and adapters
    path: str  # the adapter GGUF, an absolute path on the workers' host
    model: str | None = None  # its base model (None: the pool's first)
    scale: float = 1.0  # the scale a request that names it without one gets


# ---------------------------------------------------------------- router -> client


@dataclass(slots=True)
class Chunk:
    """A streamed text delta; ``tokens`` is the number of tokens generated so far."""

    TYPE: ClassVar[str] = "chunk"
    id: str
    index: int
    text: str
    tokens: int
    logprobs: list[TokenLogprob] | None = None  # per token of ``text`` (docs/protocol.md)
    prompt_tokens: int | None = None  # on a prompt's first chunk: its prompt tokens (else not sent)
    cached_tokens: int | None = None  # on a prompt's first chunk: of those, served from the prefix cache
    ratelimit: dict[str, Any] | None = None  # on a prompt's first chunk: its tenant's limit state (Result's)


@dataclass(slots=True)
class Result:
    """The final reply for one prompt."""

    TYPE: ClassVar[str] = "result"
    id: str
    index: int
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    worker: str
    model: str = ""  # the model that answered
    tool_calls: list[dict[str, Any]] | None = None  # parsed calls: [{"id", "name", "arguments"}]; ``text``
    # is then the text outside them
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # as Chunk's, for the whole text
    stop: str = ""  # the stop string that ended it ("" for any other end)
    # its tenant's rate-limit state (a tenant with rpm or tpm): limit_requests, remaining_requests,
    # reset_requests (seconds), the same for tokens; an Error's also retry_after (docs/protocol.md)
    ratelimit: dict[str, Any] | None = None


@dataclass(slots=True)
class Embedding:
    """The final reply for one input of an ``embed``: its vector, L2-normalised, as float32
    little-endian bytes (msgpack bin; ``len / 4`` dimensions)."""

    TYPE: ClassVar[str] = "embedding"
    id: str
    index: int
    embedding: bytes
    prompt_tokens: int
    worker: str
    model: str = ""


@dataclass(slots=True)
class TokenizeReply:
    """``tokens``: token ids, or ``{"id", "piece"}`` maps with ``with_pieces`` (a piece that is not
    valid UTF-8 is the list of its byte values, as llama-server gives it)."""

    TYPE: ClassVar[str] = "tokenize_reply"
    id: str
    tokens: list[Any]
    worker: str
    model: str = ""


@dataclass(slots=True)
class DetokenizeReply:
    TYPE: ClassVar[str] = "detokenize_reply"
    id: str
    content: str
    worker: str
    model: str = ""


@dataclass(slots=True)
class Error:
    """A final error reply. ``id``/``index`` are None when the request could not be read."""

    TYPE: ClassVar[str] = "error"
    id: str | None
    code: str
    message: str
    index: int | None = None
    field: str | None = None
    tokens_delivered: int | None = None
    ratelimit: dict[str, Any] | None = None  # as Result's (a rate_limited error: with retry_after)


@dataclass(slots=True)
class StatusReply:
    TYPE: ClassVar[str] = "status_reply"
    id: str
    workers: list[dict[str, Any]]
    queued: int
    running: int
    draining: bool = False
    gpus: list[dict[str, Any]] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)  # name, workers, queued; the first is the default


@dataclass(slots=True)
class ModelActionReply:
    """What a :class:`ModelAction` did: the model's state after it (``loading``, ``loaded``,
    ``unloading``, ``unloaded``) and a sentence for a person."""

    TYPE: ClassVar[str] = "model_action_reply"
    id: str
    model: str
    action: str
    state: str
    message: str = ""
    pinned: bool = False


@dataclass(slots=True)
class MetricsReply:
    """The Prometheus text exposition format (version 0.0.4), rendered by the router."""

    TYPE: ClassVar[str] = "metrics_reply"
    id: str
    text: str


# ---------------------------------------------------------------- worker <-> router


@dataclass(slots=True)
class Hello:
    """First message of a worker: who it is and what llama.cpp sees in its process."""

    TYPE: ClassVar[str] = "hello"
    worker: str
    pid: int
    device: str
    model: str
    slots: int
    ctx_per_slot: int
    n_vocab: int
    visible_devices: list[str]
    model_name: str = ""  # the model's name in the pool; "" -> the pool's first model
    node: str = ""  # the remote node it belongs to ("" for the router's own workers); its name is "node/..."
    boot: str = ""  # the boot id its supervisor handed it: a router takes only its own daemon's workers


@dataclass(slots=True)
class Heartbeat:
    """Liveness, both ways. From a worker it also carries its load and step progress."""

    TYPE: ClassVar[str] = "heartbeat"
    active: int = 0
    steps: int = 0
    busy_for: float = 0.0  # seconds the current engine step has been running (0 when idle)
    decode_s: float = 0.0  # cumulative seconds inside llama_decode
    step_s: float = 0.0  # cumulative seconds of whole engine steps
    reused_tokens: int = 0  # cumulative prompt tokens served from the prefix cache
    kv_used: int = 0  # KV cache cells holding tokens (running sequences and kept prefixes)
    kv_total: int = 0  # KV cache cells in all (0: not reported)
    step_target: str = ""  # model.target_step as the worker runs it ("" from an engine without one)
    step_budget: int = 0  # the token budget of its last step
    step_cost: list[float] = field(default_factory=list)  # fitted step cost, seconds: base, per row,
    # per prompt token, per step with prompt work ([] until fitted)
    draining: bool = False  # from a worker: it was told to stop (SIGTERM); route nothing more to it
    # speculative decoding, cumulative: draft tokens verified, accepted, tokens sampled, (sequence, step)
    # pairs sampled ([] from an engine without it)
    speculation: list[int] = field(default_factory=list)
    # the host KV tier's counters (worker/engine/hostkv.py TierStats; {} without a tier)
    kv_host: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Run:
    """Router -> worker: start one sequence. ``rid`` is unique per router; ``req`` is the request id
    for logs (the client's ``Generate.id``, ``/index`` appended for a micro-batch's prompts)."""

    TYPE: ClassVar[str] = "run"
    rid: int
    prompt: Prompt
    params: SamplingParams
    stream: bool
    req: str = ""
    task: str = ""  # "" (generate), "embed", "rerank", "tokenize" or "detokenize" (``prompt``: the text or
    # token ids; a rerank's: the document)
    options: dict[str, Any] | None = None  # a tokenize's add_special, parse_special, with_pieces; a rerank's
    # query and max_tokens_per_doc
    after: int = -1  # one of ``n`` choices: the rid of its first choice, whose computed prompt it copies


TASKS = ("", "embed", "rerank", "tokenize", "detokenize")
LIGHT_TASKS = ("tokenize", "detokenize")  # answered on a worker's I/O path: they take no slot


@dataclass(slots=True)
class Abort:
    """Router -> worker: stop a sequence; the worker answers with a ``cancelled`` finish."""

    TYPE: ClassVar[str] = "abort"
    rid: int


class Delta(NamedTuple):
    """New text of a running sequence: ``[rid, text, tokens, logprobs, prompt_tokens, cached_tokens]`` on
    the wire (the trailing ones optional). ``logprobs``: the worker's records; the router holds them as
    the arrays they travel as and passes them on unread (the client's codec makes them records again)."""

    rid: int
    text: str
    tokens: int  # tokens generated so far
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0  # the prompt's tokens (the router passes them on with the first chunk)
    cached_tokens: int = 0  # of which served from the prefix cache


class Done(NamedTuple):
    """A finished sequence: ``[rid, finish_reason, text, prompt_tokens, completion_tokens]``."""

    rid: int
    reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[dict[str, Any]] | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    embedding: bytes | None = None  # an embed task's vector (float32 little-endian); a rerank's score
    tokens: list[Any] | None = None  # a tokenize task's tokens (``text`` is a detokenize task's text)
    stop: str = ""  # the stop string that ended it ("" for any other end)


class Failed(NamedTuple):
    """A sequence that failed: ``[rid, code, message, field]``."""

    rid: int
    code: str
    message: str
    field: str | None


@dataclass(slots=True)
class Step:
    """Worker -> router, once per engine step: every sequence's delta and every finish (each entry
    a named tuple, an array on the wire)."""

    TYPE: ClassVar[str] = "step"
    deltas: list[Delta] = field(default_factory=list)
    done: list[Done] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    active: int = 0


@dataclass(slots=True)
class UnloadAdapter:
    """Router -> worker: free a run-time LoRA adapter once no sequence uses it (those running finish first);
    answered with :class:`AdapterDone`."""

    TYPE: ClassVar[str] = "unload_adapter"
    name: str


@dataclass(slots=True)
class AdapterDone:
    """Worker -> router: a :class:`LoadAdapter` (``action`` "load") or :class:`UnloadAdapter` ("unload")
    carried out (``error`` "") or refused (``error``: why, for the operator; ``field``: the load's parameter
    it names)."""

    TYPE: ClassVar[str] = "adapter_done"
    name: str
    action: str
    error: str = ""
    field: str = "path"


@dataclass(slots=True)
class Shutdown:
    """Router -> worker: finish or abort what runs, then exit. With a ``reason`` the router refused the
    worker's hello (a name clash): the worker logs it and exits for good. Worker -> router: it leaves."""

    TYPE: ClassVar[str] = "shutdown"
    reason: str = ""


@dataclass(slots=True)
class KVPart:
    """A draining worker's host KV tier entry, in parts: worker -> router -> a ready sibling worker of the
    same model, which keeps it if it is its model's and build's (``identity``) and intact (``crc``, zlib's
    crc32 of the whole state). ``tokens`` (int32 bytes) and the check fields come with part 0."""

    TYPE: ClassVar[str] = "kv_part"
    key: int  # the entry's number in its worker's handover
    part: int
    parts: int
    data: bytes  # a piece of llama.cpp's serialized sequence state
    tokens: bytes = b""
    identity: bytes = b""
    crc: int = 0
    source: str = ""  # set by the router: the worker it came from (a receiver joins parts per source)


Message = (
    Generate
    | Embed
    | Rerank
    | Tokenize
    | Detokenize
    | Cancel
    | StatusRequest
    | MetricsRequest
    | ModelAction
    | ModelActionReply
    | LoadAdapter
    | UnloadAdapter
    | AdapterDone
    | Chunk
    | Result
    | Embedding
    | TokenizeReply
    | DetokenizeReply
    | Error
    | StatusReply
    | MetricsReply
    | Hello
    | Heartbeat
    | Run
    | Abort
    | Step
    | Shutdown
    | KVPart
)
