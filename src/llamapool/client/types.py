"""What the client SDK returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    worker: str  # id of the worker that served it
    index: int = 0
    model: str = ""  # the pool's model that served it


@dataclass(frozen=True)
class StreamChunk:
    text: str
    tokens: int  # tokens generated so far
    index: int = 0
