"""The llama.cpp engine, split along its step's phases: ``core`` (the step), ``model`` (llama.cpp set-up),
``sequence`` (a request's state), ``kvcache`` (slots and the prefix cache), ``prompt`` (tokenising),
``batch`` (filling the ``llama_batch``), ``output`` (text, logprobs, results) and ``speculator``
(speculation: its pieces in ``spec``, prompt lookup in ``ngram``)."""

from llamapool.worker.engine.core import Engine
from llamapool.worker.engine.model import (
    EngineConfig,
    EngineError,
    context_params,
    load_model,
    model_params,
    quiet_llama_logs,
    visible_gpus,
)
from llamapool.worker.engine.sequence import ContextLengthExceeded, Sequence, Waiting

__all__ = [
    "ContextLengthExceeded",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Sequence",
    "Waiting",
    "context_params",
    "load_model",
    "model_params",
    "quiet_llama_logs",
    "visible_gpus",
]
