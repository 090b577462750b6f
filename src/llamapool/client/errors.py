"""Typed client exceptions, one per error code family."""

from __future__ import annotations

from llamapool.protocol.messages import Error, ErrorCode


class LlamapoolError(Exception):
    """An error reply from the daemon (or the client's own timeout)."""

    def __init__(self, code: str, message: str, field: str | None = None,
                 tokens_delivered: int | None = None, index: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.tokens_delivered = tokens_delivered
        self.index = index
        self.ratelimit: dict[str, object] | None = None  # the tenant's rate-limit state (a rate_limited error's
        # has ``retry_after``, seconds)

    def __reduce__(self) -> tuple[type[LlamapoolError], tuple[str, str, str | None, int | None, int | None]]:
        """Picklable, so an error raised in a worker process of the caller's own pool reaches its parent."""
        return type(self), (self.code, self.message, self.field, self.tokens_delivered, self.index)


class BadRequestError(LlamapoolError):
    """The request was malformed or a field was invalid (``.field`` names it)."""


class UnknownModelError(BadRequestError):
    """The request named a model that is not in the pool (``.field == "model"``; the message lists
    the pool's models)."""


class OverloadedError(LlamapoolError):
    """The daemon's queue is full; retry later."""


class RateLimitedError(OverloadedError):
    """The tenant's limits (its API key's: concurrency, requests or tokens a minute, share of the queue)
    refuse the request now; ``.ratelimit["retry_after"]`` says when to try again."""


class ForbiddenError(BadRequestError):
    """The tenant may not ask for this: a priority class above its key's cap (``.field == "priority"``)."""


class RequestTimeoutError(LlamapoolError, TimeoutError):
    """The request's deadline passed (on the daemon or while waiting for it)."""


class UnavailableError(LlamapoolError):
    """No worker could take the request (none ready, or the daemon is stopping or unreachable)."""


class WorkerLostError(LlamapoolError):
    """The worker died mid-stream; ``.tokens_delivered`` tokens had already been streamed."""


class InternalError(LlamapoolError):
    """The engine failed on this request."""


_BY_CODE: dict[str, type[LlamapoolError]] = {
    ErrorCode.MALFORMED: BadRequestError,
    ErrorCode.UNSUPPORTED_VERSION: BadRequestError,
    ErrorCode.UNKNOWN_TYPE: BadRequestError,
    ErrorCode.INVALID_REQUEST: BadRequestError,
    ErrorCode.TOO_LARGE: BadRequestError,
    ErrorCode.DUPLICATE_ID: BadRequestError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.TIMEOUT: RequestTimeoutError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.WORKER_LOST: WorkerLostError,
    ErrorCode.NO_CHAT_TEMPLATE: BadRequestError,
    ErrorCode.UNKNOWN_MODEL: UnknownModelError,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: BadRequestError,
    ErrorCode.RATE_LIMITED: RateLimitedError,
    ErrorCode.FORBIDDEN: ForbiddenError,
}


def from_reply(err: Error) -> LlamapoolError:
    cls = _BY_CODE.get(err.code, InternalError)
    e = cls(err.code, err.message, err.field, err.tokens_delivered, err.index)
    e.ratelimit = err.ratelimit
    return e
