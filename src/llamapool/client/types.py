"""What the client SDK returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llamapool.protocol.messages import TokenLogprob


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: ``arguments`` is JSON text (parse it with ``json.loads``)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" | "length" | "tool_calls" | "cancelled"
    usage: Usage
    worker: str  # id of the worker that served it
    index: int = 0
    model: str = ""  # the pool's model that served it
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls (``text``: the prose)
    stop: str = ""  # the stop string that ended it ("" for any other end)
    logprobs: list[TokenLogprob] | None = None  # with logprobs=True: one record per generated token (with
    # echo, per prompt token first); a stream's are in its chunks
    ratelimit: dict[str, Any] | None = None  # its tenant's rate-limit state (docs/protocol.md), when it has limits


@dataclass(frozen=True)
class StreamChunk:
    text: str
    tokens: int  # tokens generated so far
    index: int = 0
    logprobs: list[TokenLogprob] | None = None  # with logprobs=True: the records of the tokens since the last chunk
    prompt_tokens: int | None = None  # on a prompt's first chunk: its prompt tokens (None on the others)
    cached_tokens: int | None = None  # on a prompt's first chunk: of those, served from the prefix cache
    ratelimit: dict[str, Any] | None = None  # on a prompt's first chunk: its tenant's rate-limit state


class Embeddings(list[list[float]]):
    """What ``embed`` returns: one vector per input, in order (L2-normalised floats), as a list; with the
    prompt tokens of all inputs, the model that answered, and each vector as the daemon sent it
    (``raw``: float32 little-endian bytes, what OpenAI's ``encoding_format="base64"`` encodes)."""

    def __init__(self, raw: list[bytes], prompt_tokens: int, model: str):
        import array

        super().__init__(array.array("f", r).tolist() for r in raw)
        self.raw, self.prompt_tokens, self.model = raw, prompt_tokens, model


@dataclass(frozen=True)
class RerankResult:
    """One document's relevance to the query: its position in the request, its score (the reranker's
    raw output: a logit, higher is more relevant; Qwen3-Reranker's is a probability) and its text."""

    index: int
    relevance_score: float
    document: str


class Reranking(list[RerankResult]):
    """What ``rerank`` returns: the documents' results sorted by ``relevance_score``, highest first (ties
    in the documents' order), the first ``top_n`` of them; with the prompt tokens of all pairs scored
    and the model that answered."""

    def __init__(self, results: list[RerankResult], prompt_tokens: int, model: str):
        super().__init__(results)
        self.prompt_tokens, self.model = prompt_tokens, model
