"""How fast one client's request bodies are read: `--max-body-rate` bytes a second.

Reading a body and checking it costs the ingress's event loop about 4 ms a megabyte before
anything can refuse it (issue 30: two loops of 7 MB bodies, each a cheap 400, kept it busy
300 MB a second and tripled another tenant's time to first token). Each client (its tenant,
or its address where no key is asked for) has a bucket of `rate` bytes a second that holds
at most `burst` (at least one largest body, so one body of any allowed size never waits). A
body takes its size from the bucket before it is read; while the bucket is in debt, the
client's next body waits unread, on its own connection: its pace is its own, and the loop
stays with everyone else.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tokenway.aio import Signal

_FORGET_ABOVE = 4096  # clients remembered before the full buckets are forgotten


@dataclass
class BodyRate:
    rate: float  # bytes a second a client's bodies may take; 0: no bound
    burst: float  # bytes a client may take at once (its bucket's size)
    waiting: int = 0  # bodies waiting for their client's bucket now
    began_waiting: Signal = field(default_factory=Signal)
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # (bytes, at)

    def _level(self, client: str, now: float) -> float:
        left, at = self._buckets.get(client, (self.burst, now))
        return min(self.burst, left + (now - at) * self.rate)

    async def admit(self, client: str, size: int) -> None:
        """Once `client`'s bucket is out of debt, `size` bytes taken from it (into debt, for
        a body bigger than what is left)."""
        if not self.rate:
            return
        while (level := self._level(client, now := time.monotonic())) < 0:
            self.waiting += 1
            self.began_waiting.fire()
            try:
                await asyncio.sleep(-level / self.rate)
            finally:
                self.waiting -= 1
        self._buckets[client] = (level - size, now)
        if len(self._buckets) > _FORGET_ABOVE:
            self._buckets = {
                c: b for c, b in self._buckets.items() if self._level(c, now) < self.burst
            }

    def charge(self, client: str, size: int) -> None:
        """`size` more bytes taken (a body that did not say its length before it came)."""
        if self.rate and size:
            now = time.monotonic()
            self._buckets[client] = (self._level(client, now) - size, now)
