"""W3C Trace Context: the `traceparent` a request carries through every hop to its engine.

The client's, when it sends a valid one, else a new one. Without `--otlp-endpoint`
tokenway makes no spans and passes the context on unchanged (a valid participant that is
not sampling); with it, each hop passes on its own span's (`tokenway.spans`).
"""

from __future__ import annotations

import re
import secrets

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def valid(given: str) -> str | None:
    """`given` when it is a valid version-00 `traceparent`, else None."""
    match = _TRACEPARENT.fullmatch(given.strip())
    if match and match.group(1) != _ZERO_TRACE and match.group(2) != _ZERO_SPAN:
        return match.group(0)
    return None


def traceparent(given: str) -> str:
    """`given` when valid, else a new trace's (an invalid one starts a new trace, as the
    recommendation says)."""
    return valid(given) or f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
