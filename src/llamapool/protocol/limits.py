"""The limits of the generation parameters: one table for the wire protocol, the SDK and the HTTP API.

Every bad value gets the same message wherever it arrives, naming the public parameter
(``'temperature' must be a number from 0 to 2, got 3.5``), with numbers printed as written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**32 - 1
MAX_DRAFT = 8  # draft tokens a step at most (speculative decoding: worker/engine/spec.py)
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_LOGIT_BIAS = 1024  # token ids per logit_bias map
MAX_TOKEN_ID = 2**31 - 1  # a logit_bias key (the worker also checks it against the model's vocab)
MAX_LORA = 16  # LoRA adapter entries per request (``lora``)
MAX_LORA_SCALE = 16.0  # a LoRA adapter's scale, per request and in [[models.lora]]: finite, |scale| <= this


@dataclass(frozen=True)
class Limit:
    """A numeric parameter's range: ``lo`` (excluded when ``lo_open``) to ``hi``, integer or not."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False

    def rule(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.lo_open:
            return f"{kind} above {show(self.lo)} and at most {show(self.hi)}"
        return f"{kind} from {show(self.lo)} to {show(self.hi)}"

    def ok(self, v: float) -> bool:
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi


PARAMS: dict[str, Limit] = {
    "max_tokens": Limit(1, 2**30, integer=True),
    "temperature": Limit(0, 2),  # OpenAI's range; 0 is greedy
    "top_k": Limit(0, 2**20, integer=True),  # 0: off
    "top_p": Limit(0, 1, lo_open=True),
    "min_p": Limit(0, 1),
    "repeat_penalty": Limit(0, 10, lo_open=True),
    "seed": Limit(0, MAX_SEED, integer=True),
    "presence_penalty": Limit(-2, 2),  # OpenAI's ranges and semantics (over the generated tokens)
    "frequency_penalty": Limit(-2, 2),
    "logit_bias": Limit(-100, 100),  # each bias of the map
    "top_logprobs": Limit(0, 20, integer=True),  # OpenAI chat's range (its completions take 0 to 5)
    "n": Limit(1, 128, integer=True),  # choices per prompt (a worker also refuses more than its slots)
}


def show(v: Any) -> str:
    """A number as its writer wrote it: 1073741824, 0.7, 1e-05 (never 1.07374e+09)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(v)


def is_number(v: Any, integer: bool) -> bool:
    if isinstance(v, bool):
        return False
    if integer:
        return isinstance(v, int)
    return isinstance(v, (int, float)) and math.isfinite(v)


def problem(name: str, v: Any) -> str | None:
    """None when ``v`` is a good value of the parameter ``name``, else what is wrong, naming it."""
    limit = PARAMS[name]
    if not is_number(v, limit.integer) or not limit.ok(v):
        return f"'{name}' must be {limit.rule()}, got {show(v)}"
    return None
