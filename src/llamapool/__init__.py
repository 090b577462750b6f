"""llamapool: serve llama.cpp models from one worker process per GPU behind a ZeroMQ router."""

from llamapool.client import (
    AsyncClient,
    BadRequestError,
    Client,
    Completion,
    InternalError,
    LlamapoolError,
    OverloadedError,
    RequestTimeoutError,
    Stream,
    StreamChunk,
    UnavailableError,
    Usage,
    WorkerLostError,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "BadRequestError", "Client", "Completion", "InternalError", "LlamapoolError",
    "OverloadedError", "RequestTimeoutError", "Stream", "StreamChunk", "UnavailableError", "Usage",
    "WorkerLostError", "__version__",
]
