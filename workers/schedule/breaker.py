"""Circuit breakers, one per engine: stop sending work to an engine that keeps failing (pure).

closed ──(threshold consecutive failures)──▶ open ──(back-off elapsed)──▶ half-open
half-open: one request (the probe) goes through; its success closes the breaker and resets
the back-off, its failure opens it again with the back-off doubled (up to the cap).

`admits` only looks; `allow` also claims the probe of a half-open breaker, so call it once,
for the engine actually chosen. A probe that never reports (its request was cancelled
before the engine answered) is either released with `abandon` or, failing that, forgotten
after `probe_timeout`, so a lost probe cannot hold an engine out forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass(slots=True)
class _Breaker:
    failures: int = 0  # consecutive, while closed
    trips: int = 0  # openings since the last success: the back-off exponent
    until: float | None = None  # open until then; None while closed
    probe_since: float | None = None  # when the half-open probe was let through


class Breakers:
    def __init__(
        self,
        threshold: int = 3,
        base: float = 1.0,
        factor: float = 2.0,
        cap: float = 60.0,
        probe_timeout: float = 30.0,
    ) -> None:
        if threshold < 1 or base <= 0 or factor < 1 or cap < base or probe_timeout <= 0:
            raise ValueError(
                f"invalid breaker settings: threshold={threshold} base={base} "
                f"factor={factor} cap={cap} probe_timeout={probe_timeout}"
            )
        self.threshold = threshold
        self.base = base
        self.factor = factor
        self.cap = cap
        self.probe_timeout = probe_timeout
        self._engines: dict[str, _Breaker] = {}

    def backoff(self, trips: int) -> float:
        """How long the breaker stays open after its `trips`-th opening in a row (1-based)."""
        return min(self.base * self.factor ** (trips - 1), self.cap)

    def state(self, engine_id: str, now: float) -> State:
        b = self._engines.get(engine_id)
        if b is None or b.until is None:
            return "closed"
        return "open" if now < b.until else "half_open"

    def admits(self, engine_id: str, now: float) -> bool:
        """Whether `allow` would let a request through now; claims nothing."""
        b = self._engines.get(engine_id)
        if b is None or b.until is None:
            return True
        if now < b.until:
            return False
        return b.probe_since is None or now - b.probe_since >= self.probe_timeout

    def allow(self, engine_id: str, now: float) -> bool:
        """Whether to send a request to the engine; a half-open engine's yes is its probe."""
        if not self.admits(engine_id, now):
            return False
        b = self._engines.get(engine_id)
        if b is not None and b.until is not None:
            b.probe_since = now
        return True

    def on_success(self, engine_id: str, now: float) -> None:
        """The engine did what was asked: close the breaker and reset the back-off."""
        b = self._engines.get(engine_id)
        if b is not None and b.until is not None and b.probe_since is None:
            return  # open, no probe out: a request sent before it opened, proving nothing
        self._engines.pop(engine_id, None)

    def on_failure(self, engine_id: str, now: float) -> None:
        """The engine failed a request (no answer, error, lost mid-stream)."""
        b = self._engines.get(engine_id)
        if b is None:
            b = self._engines[engine_id] = _Breaker()
        if b.until is None:
            b.failures += 1
            if b.failures >= self.threshold:
                self._open(b, now)
        elif b.probe_since is not None:
            self._open(b, now)
        # Open and no probe out: a request sent before the breaker opened failed late.
        # The opening already accounts for it; it neither extends nor re-arms anything.

    def abandon(self, engine_id: str, now: float) -> None:
        """The probe ended without a verdict (cancelled): let the next request probe."""
        b = self._engines.get(engine_id)
        if b is not None:
            b.probe_since = None

    def forget(self, engine_id: str) -> None:
        """The engine left the registry; a new one under that id starts closed."""
        self._engines.pop(engine_id, None)

    def _open(self, b: _Breaker, now: float) -> None:
        b.trips += 1
        b.failures = 0
        b.until = now + self.backoff(b.trips)
        b.probe_since = None
