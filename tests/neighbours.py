"""Requests decoding beside the ones a test holds: each job (model, prompt, parameters) streamed again
and again in a thread of its own from before the held requests until after them."""

from __future__ import annotations

import threading
from typing import Any

from .conftest import Daemon

Job = tuple[str, str, dict[str, Any]]  # model, prompt, the stream's parameters


class Neighbours:
    """A context manager: entered once every job's stream has 2 tokens (so the held requests arrive
    mid-decode), left after every thread stopped; a failed stream fails the exit."""

    def __init__(self, d: Daemon, jobs: list[Job]):
        self.d, self.stop, self.errors = d, threading.Event(), list[BaseException]()
        self.decoding = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._run, args=job) for job in jobs]

    def _run(self, model: str, prompt: str, params: dict[str, Any]) -> None:
        signalled = False
        try:
            with self.d.client() as c:
                while not self.stop.is_set():
                    for chunk in c.stream(prompt, model=model, **params):
                        if chunk.tokens >= 2 and not signalled:
                            signalled = True
                            self.decoding.release()
                        if self.stop.is_set():
                            break
        except BaseException as e:
            self.errors.append(e)
        finally:
            if not signalled:
                self.decoding.release()

    def __enter__(self) -> Neighbours:
        for t in self.threads:
            t.start()
        for _ in self.threads:
            assert self.decoding.acquire(timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not self.errors, self.errors
