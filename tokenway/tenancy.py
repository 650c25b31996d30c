"""What a tenant may use, and whether one more request fits (pure).

A tenant's limits ride its requests (`Tw-Limits`, set by the ingress from its key file);
its usage is one record in the `tw-tenants` bucket, updated by compare-and-set from any
render worker and released by the owner that ends the request, so every ingress and
worker sees one count. Usage holds:

- `leases`: the requests running (rid → when the lease lapses: the request's deadline, so
  a request whose owner vanished cannot hold its slot for ever). A request admitted again
  (its render message redelivered) keeps its lease and is not charged twice.
- `tat`: the token budget as a GCRA's theoretical arrival time. Each admitted request
  moves it by its tokens × (60 s / tokens_per_minute); it may run up to a minute ahead
  of now, so a full minute's budget may be spent at once and then refills evenly.
"""

from __future__ import annotations

import math

import msgspec

WINDOW = 60.0  # seconds: the "per minute"
RETRY_BUSY = 1  # Retry-After while every concurrent slot is taken (when one frees is unknown)


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """0 means no limit."""

    concurrent: int = 0
    tokens_per_minute: int = 0

    def __bool__(self) -> bool:
        return bool(self.concurrent or self.tokens_per_minute)

    def header(self) -> str:
        return f"c={self.concurrent},t={self.tokens_per_minute}"

    @classmethod
    def parse(cls, text: str) -> Limits:
        """`c=N,t=N` (`Tw-Limits`); ValueError when it is not that."""
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        limits = cls(concurrent=int(fields.get("c", 0)), tokens_per_minute=int(fields.get("t", 0)))
        if limits.concurrent < 0 or limits.tokens_per_minute < 0:
            raise ValueError(f"negative limit in {text!r}")
        return limits


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    tat: float = 0.0
    leases: dict[str, float] = {}


class Refused(msgspec.Struct, frozen=True):
    """Why the request may not run now; `retry_after` seconds until it may (0: never)."""

    why: str
    retry_after: int


def admit(
    usage: Usage, limits: Limits, rid: str, cost: int, now: float, until: float
) -> Usage | Refused:
    """The usage with the request admitted (leased until `until`), or why it is refused."""
    leases = {r: t for r, t in usage.leases.items() if t > now}
    if rid in leases:
        return Usage(tat=usage.tat, leases=leases)
    tat = usage.tat
    if limits.tokens_per_minute:
        if cost > limits.tokens_per_minute:
            return Refused(
                f"the request needs {cost} tokens (prompt + max_tokens × n), over this key's "
                f"limit of {limits.tokens_per_minute} tokens per minute; ask for fewer "
                "max_tokens",
                0,
            )
        tat = max(tat, now) + cost * WINDOW / limits.tokens_per_minute
        if (early := tat - now - WINDOW) > 0:
            return Refused(
                f"this key's limit of {limits.tokens_per_minute} tokens per minute is spent; "
                f"the request needs {cost}",
                math.ceil(early),
            )
    if limits.concurrent and len(leases) >= limits.concurrent:
        return busy(limits)
    leases[rid] = until
    return Usage(tat=tat, leases=leases)


def busy(limits: Limits) -> Refused:
    """Every concurrent slot is taken (by the bucket's count, or by one ingress's own: a
    request it holds runs or waits to, so its count never exceeds what it may run)."""
    return Refused(
        f"this key already runs its limit of {limits.concurrent} concurrent requests",
        RETRY_BUSY,
    )


def release(usage: Usage, rid: str, now: float) -> Usage | None:
    """The usage without the request's lease; None when it holds none (nothing to write)."""
    if rid not in usage.leases:
        return None
    leases = {r: t for r, t in usage.leases.items() if t > now and r != rid}
    return Usage(tat=usage.tat, leases=leases)
