"""What a tenant may keep in the shared stores, and whether one more thing fits (pure).

Two stores are shared by every tenant: `tw-files` (Batch API files: uploads, and the batch
runner's parts and output files, charged to the batch's tenant) and `tw-responses` (stored
Responses API responses). Each tenant has a quota of bytes and of things in each (`Quota`,
from its key-file line or the `--tenant-*` defaults; 0 is no limit), and one small usage
record (`Kept`) in the `tw-stored` bucket, changed compare-and-set by every ingress and
batch runner (`tokenway.quota_book`). A keyless deployment's requests are all of tenant "",
so it has one quota, shared by every client.

Files stay until they are deleted, so their usage is a plain tally that a delete gives back.
Stored responses also leave by themselves, at the bucket's max age: their usage is kept per
*expiry slot* (the end of the slot of width `slot_width(ttl)` in which they expire), and a
slot that has ended counts no more. So expiry gives usage back without anyone deleting
anything, at most one slot late, and the record holds at most about `SLOTS` slots.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from tokenway.errors import InvalidRequest

Store = Literal["files", "responses"]
FILES: Store = "files"
RESPONSES: Store = "responses"
CODE = "storage_quota_exceeded"
SLOTS = 64  # a stored response's usage is given back at most 1/SLOTS of its age late


class Quota(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tenant's share of each store, in bytes and in things (0: no limit)."""

    files_bytes: int = 0
    files_count: int = 0
    responses_bytes: int = 0
    responses_count: int = 0

    def of(self, store: Store) -> Tally:
        """The limits in `store`, as a tally (count, bytes)."""
        if store == FILES:
            return Tally(self.files_count, self.files_bytes)
        return Tally(self.responses_count, self.responses_bytes)


UNLIMITED = Quota()


class Tally(msgspec.Struct, array_like=True):
    count: int = 0
    bytes: int = 0


class Kept(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tenant's usage of the stores."""

    files: Tally = msgspec.field(default_factory=Tally)
    # slot end (epoch seconds) → the responses that expire within the slot ending then
    responses: dict[int, Tally] = {}
    quota: Quota | None = None  # the quota last charged against (what `tokenway status` shows)

    def used(self, store: Store, now: float) -> Tally:
        if store == FILES:
            return self.files
        live = [t for end, t in self.responses.items() if end > now]
        return Tally(sum(t.count for t in live), sum(t.bytes for t in live))


class Charge(msgspec.Struct, frozen=True):
    """Things added to (or, negative, taken from) a store: `expires` for a stored response
    (epoch seconds), with the width of its slot."""

    store: Store
    count: int
    bytes: int
    expires: float = 0.0
    width: float = 1.0

    def slot(self) -> int:
        return int(math.ceil(self.expires / self.width) * self.width)


class QuotaExceeded(InvalidRequest):
    """Past the tenant's quota of a store: OpenAI answers a full file storage with a 400
    (`invalid_request_error`), and asking again does not help until something is deleted."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message, param=param, code=CODE)


def slot_width(ttl: float) -> float:
    """The slot width of a store whose records live `ttl` seconds."""
    return max(ttl / SLOTS, 1.0)


def charge(kept: Kept, quota: Quota | None, c: Charge, now: float, force: bool = False) -> Kept:
    """The usage with `c` added; `QuotaExceeded` when that is past the quota (unless
    `force`: a thing already made, such as a response its client has, is counted whatever
    it costs; so is anything without a `quota`, such as a batch's output file replacing its
    parts). A charge that takes nothing away is never refused."""
    used, limit = kept.used(c.store, now), (quota or UNLIMITED).of(c.store)
    after = Tally(used.count + c.count, used.bytes + c.bytes)
    grows = c.count > 0 or c.bytes > 0
    if grows and not force:
        if limit.count and after.count > limit.count:
            raise over(c.store, used, limit, f"{c.count} more", "count")
        if limit.bytes and after.bytes > limit.bytes:
            raise over(c.store, used, limit, f"{c.bytes} bytes more", "bytes")
    return _added(kept, c, now, quota or kept.quota)


def release(kept: Kept, c: Charge, now: float) -> Kept:
    """The usage without what `c` added (never below nothing)."""
    return _added(kept, Charge(c.store, -c.count, -c.bytes, c.expires, c.width), now, kept.quota)


def admits(kept: Kept, quota: Quota, store: Store, now: float) -> None:
    """`QuotaExceeded` when the tenant has no room left in `store` at all (a request that
    would store a response of a size not known yet, a batch that will write files)."""
    used, limit = kept.used(store, now), quota.of(store)
    if limit.count and used.count >= limit.count:
        raise over(store, used, limit, "any more", "count")
    if limit.bytes and used.bytes >= limit.bytes:
        raise over(store, used, limit, "any more", "bytes")


def _added(kept: Kept, c: Charge, now: float, quota: Quota | None) -> Kept:
    if c.store == FILES:
        files = Tally(max(kept.files.count + c.count, 0), max(kept.files.bytes + c.bytes, 0))
        return Kept(files=files, responses=_live(kept.responses, now), quota=quota)
    slots = _live(kept.responses, now)
    end = c.slot()
    if end > now:  # one that has expired already counts no more
        was = slots.get(end, Tally())
        slots[end] = Tally(max(was.count + c.count, 0), max(was.bytes + c.bytes, 0))
        if slots[end] == Tally():
            del slots[end]
    return Kept(files=kept.files, responses=slots, quota=quota)


def _live(slots: dict[int, Tally], now: float) -> dict[int, Tally]:
    return {end: t for end, t in slots.items() if end > now}


_WHAT = {FILES: ("files", "file"), RESPONSES: ("stored responses", "store")}
_FIELD = {
    (FILES, "count"): "files_count",
    (FILES, "bytes"): "files_bytes",
    (RESPONSES, "count"): "responses_count",
    (RESPONSES, "bytes"): "responses_bytes",
}


def over(store: Store, used: Tally, limit: Tally, wanted: str, which: str) -> QuotaExceeded:
    """The refusal, naming the quota, what the tenant keeps and what it asked for."""
    things, param = _WHAT[store]
    cap = f"{limit.count} {things}" if which == "count" else f"{limit.bytes} bytes of {things}"
    return QuotaExceeded(
        f"You have exceeded your storage quota of {cap} ({_FIELD[store, which]}): you keep "
        f"{used.count} {things} of {used.bytes} bytes, and {wanted} would be past it. Delete "
        f"{things} to make room"
        + (
            " (stored responses also leave by themselves at their max age)."
            if store == RESPONSES
            else "."
        ),
        param,
    )
