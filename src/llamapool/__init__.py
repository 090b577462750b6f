"""llamapool: serve llama.cpp models from one worker process per GPU behind a ZeroMQ router.

The client names are loaded lazily, so that a worker process (``python -m llamapool.worker``) can
load llama.cpp's CUDA libraries before anything else: on the H200 machines, importing numpy or
pyzmq first made model loading segfault.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncStream", "BadRequestError", "Client", "Completion", "InternalError", "LlamapoolError",
    "OverloadedError", "RequestTimeoutError", "Stream", "StreamChunk", "TokenLogprob", "TopLogprob",
    "UnavailableError", "UnknownModelError", "Usage",
    "WorkerLostError", "__version__",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import llamapool.client

        return getattr(llamapool.client, name)
    raise AttributeError(f"module 'llamapool' has no attribute {name!r}")
