"""Liveness by progress: how long requests in flight may go without a byte before the engine counts as hung.

Between bytes the limit is the profile's `[endpoint] progress_timeout`. Before a request's first body byte the
engine also owes its prefill, which grows with the prompt: the limit adds the prompts still waiting for their
first byte over the prefill rate. The front does not tokenize, so a prompt counts as its request body's length
in bytes: a token is at least one byte of the body, so the estimate is high, never low, and a long prompt is
never mistaken for a hang. The rate is the profile's `[endpoint] prefill_tokens_per_s`, or the median rate
measured here (body bytes over the wait for the first byte, prompts of RATE_MIN_TOKENS or more) when that is
slower: a loaded machine or a larger model lengthens the limit, nothing shortens it below the profile's.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable

DEFAULT_PREFILL_TOKENS_PER_S = 50.0  # a large model on CPU cores; GPU profiles may say more
RATE_MIN_TOKENS = 1024  # shorter prompts time the queue and the first decode step more than the prefill
RATE_SAMPLES = 8


class Progress:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.last = clock()  # the last byte to any request in flight (or the first request's start)
        self._owed: dict[int, tuple[float, int]] = {}  # request → (admitted at, prompt tokens) until its first byte
        self._rates: deque[float] = deque(maxlen=RATE_SAMPLES)
        self._ids = itertools.count(1)

    def begin(self, prompt_tokens: int, first_in_flight: bool) -> int:
        """A request is admitted; returns its ticket. The limit runs from the first request in flight: later
        ones do not reset it."""
        now = self.clock()
        if first_in_flight:
            self.last = now
        ticket = next(self._ids)
        if prompt_tokens > 0:
            self._owed[ticket] = (now, prompt_tokens)
        return ticket

    def byte(self, ticket: int | None = None, body: bool = False) -> None:
        """A byte went to a client; `body`: a byte of the answer's body (headers may come before the prefill)."""
        now = self.last = self.clock()
        if body and ticket in self._owed:
            admitted, tokens = self._owed.pop(ticket)
            if tokens >= RATE_MIN_TOKENS and now > admitted:
                self._rates.append(tokens / (now - admitted))

    def end(self, ticket: int | None) -> None:
        self._owed.pop(ticket, None)

    def rate(self, profile_rate: float) -> float:
        return min(profile_rate, statistics.median(self._rates)) if self._rates else profile_rate

    def limit_s(self, base_s: float, profile_rate: float) -> float:
        """progress_timeout plus the prefill the engine still owes the requests without a first byte."""
        return base_s + sum(tokens for _, tokens in self._owed.values()) / self.rate(profile_rate)
