"""An owner's waiting line (pure): whose request starts next when an engine has room.

Tenants take turns: the request whose tenant runs the fewest sequences through this owner
goes first, then lower `priority` (vLLM's convention, a tenant's own order of its requests),
then arrival. A tenant flooding with requests its limits allow thus waits behind each
request of a calmer one instead of in front of it, and `priority` cannot buy a place ahead
of another tenant. Without API keys every request is one tenant's: priority, then arrival.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Place:
    tenant: str
    priority: int
    seqs: int  # the sequences it will run (its n)
    arrival: int = 0


@dataclass
class Line:
    running: Counter[str] = field(default_factory=Counter)  # sequences started, per tenant
    _places: list[Place] = field(default_factory=list)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    def join(self, tenant: str, priority: int, seqs: int) -> Place:
        place = Place(tenant, priority, seqs, next(self._arrivals))
        self._places.append(place)
        return place

    def leave(self, place: Place) -> None:
        self._places.remove(place)

    def first(self) -> Place | None:
        """Whose turn it is (a short line: an owner pulls little beyond what fits)."""
        return min(self._places, key=self._rank, default=None)

    def _rank(self, place: Place) -> tuple[int, int, int]:
        return self.running[place.tenant], place.priority, place.arrival

    def waiting(self) -> int:
        """Sequences waiting for their turn."""
        return sum(p.seqs for p in self._places)

    def started(self, tenant: str, seqs: int) -> None:
        self.running[tenant] += seqs

    def stopped(self, tenant: str, seqs: int) -> None:
        self.running[tenant] -= seqs
        if self.running[tenant] <= 0:
            del self.running[tenant]
