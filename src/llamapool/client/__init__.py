"""Client SDK: talk to a llamapool daemon over ZeroMQ."""

from llamapool.client.aio import AsyncClient, AsyncStream
from llamapool.client.errors import (
    BadRequestError,
    ForbiddenError,
    InternalError,
    LlamapoolError,
    OverloadedError,
    RateLimitedError,
    RequestTimeoutError,
    UnavailableError,
    UnknownModelError,
    WorkerLostError,
)
from llamapool.client.sync import Client, Stream
from llamapool.client.types import Completion, Embeddings, Reranking, RerankResult, StreamChunk, ToolCall, Usage
from llamapool.protocol.messages import TokenLogprob, TopLogprob

__all__ = [
    "AsyncClient", "AsyncStream", "BadRequestError", "Client", "Completion", "Embeddings", "ForbiddenError",
    "InternalError", "LlamapoolError", "OverloadedError", "RateLimitedError", "RequestTimeoutError", "RerankResult",
    "Reranking", "Stream", "StreamChunk", "TokenLogprob", "ToolCall", "TopLogprob", "UnavailableError",
    "UnknownModelError", "Usage", "WorkerLostError",
]
