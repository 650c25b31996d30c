"""API keys: which tenant a request is made for, or why it is refused.

Keys come from `--api-key` / `TOKENWAY_API_KEY` (comma-separated, tenant `default`) and
from `--api-key-file` (`TENANT KEY [concurrent=N] [tokens_per_minute=N] [files_bytes=N]
[files_count=N] [responses_bytes=N] [responses_count=N]` per line). A tenant's limits (or
else `--tenant-concurrency` / `--tenant-tokens-per-minute`) and its storage quota (each
share its lines do not give: `--tenant-files-bytes`...) are shared by all its keys: a
tenant does not get more by holding more keys. Only their SHA-256 digests
are kept: a key is found by the digest of what the client sent, so how long a wrong guess
takes to fail depends on its digest, which tells nothing about any key's bytes (no prefix
can be learnt byte by byte, the attack a plain `==` allows). No key, nor any line of the
file, is ever put in a message or a log.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tokenway.errors import TokenwayError
from tokenway.quota import Quota
from tokenway.tenancy import Limits

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # the tenant of `--api-key` keys
# A tenant rides the bus in a header and may name NATS users and subjects later: one token.
TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
WEAK_KEY_CHARS = 16
ALWAYS_OPEN = frozenset({"/health"})  # liveness probes carry no key
OPTIONAL_OPEN = {"ready": "/ready", "metrics": "/metrics"}


_NO_LIMITS = Limits()
_NO_QUOTA = Quota()


class Unauthorized(TokenwayError):
    status = 401
    type = "AuthenticationError"


_MISSING = "Missing API key: send it as `Authorization: Bearer <key>`."
_WRONG = "Incorrect API key provided."


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class ApiKeys:
    tenants: dict[bytes, str]  # SHA-256 of a key → its tenant; empty: no key is required
    open_paths: frozenset[str] = ALWAYS_OPEN
    limits: dict[str, Limits] = field(default_factory=dict)  # tenant → its limits, if any
    quotas: dict[str, Quota] = field(default_factory=dict)  # tenant → its storage quota
    default_quota: Quota = _NO_QUOTA  # of a tenant not named (a keyless deployment's "")

    def quota(self, tenant: str) -> Quota:
        """The tenant's share of the files and responses stores (`tokenway.quota`)."""
        return self.quotas.get(tenant, self.default_quota)

    def tenant(self, path: str, authorization: bytes) -> str:
        """The request's tenant ("" where no key is asked for); `Unauthorized` otherwise."""
        if not self.tenants or path in self.open_paths:
            return ""
        scheme, _, key = authorization.strip().partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            raise Unauthorized(_MISSING, code="invalid_api_key")
        tenant = self.tenants.get(_digest(key))
        if tenant is None:
            raise Unauthorized(_WRONG, code="invalid_api_key")
        return tenant

    @classmethod
    def load(
        cls,
        keys: str | None,
        key_file: str | None,
        open_routes: str,
        default_limits: Limits = _NO_LIMITS,
        default_quota: Quota = _NO_QUOTA,
    ) -> ApiKeys:
        """From the settings; ValueError (naming the flag, never a key) when they are unusable."""
        pairs: list[tuple[str, str, str, Limits | None, dict[str, int]]]
        pairs = [
            (DEFAULT_TENANT, k.strip(), "--api-key", None, {}) for k in (keys or "").split(",")
        ]
        if keys is not None and not any(p[1] for p in pairs):
            raise ValueError("--api-key (or TOKENWAY_API_KEY) is set but holds no key")
        pairs = [p for p in pairs if p[1]]
        if key_file is not None:
            pairs += _read_key_file(key_file)
        tenants: dict[bytes, str] = {}
        own: dict[str, Limits] = {}
        shares: dict[str, dict[str, int]] = {}
        for tenant, key, where, limits, quota in pairs:
            if (limits is not None and own.setdefault(tenant, limits) != limits) or (
                quota and shares.setdefault(tenant, quota) != quota
            ):
                raise ValueError(
                    f"{where}: tenant {tenant} is given other limits on another "
                    "line; give them once, or the same on every line"
                )
            digest = _digest(key.encode())
            if tenants.setdefault(digest, tenant) != tenant:
                raise ValueError(
                    f"{where}: a key is given to two tenants, {tenants[digest]} and {tenant}"
                )
            if len(key) < WEAK_KEY_CHARS:
                log.warning(
                    "%s: a key of tenant %s has %d characters; use %d or more "
                    "(e.g. `openssl rand -hex 24`)",
                    where,
                    tenant,
                    len(key),
                    WEAK_KEY_CHARS,
                )
        tenant_limits = {t: own.get(t, default_limits) for t in set(tenants.values())}
        quotas = {
            t: msgspec.structs.replace(default_quota, **shares.get(t, {}))
            for t in set(tenants.values())
        }
        return cls(
            tenants,
            ALWAYS_OPEN | _open_paths(open_routes),
            {t: x for t, x in tenant_limits.items() if x},
            quotas,
            default_quota,
        )


def tenants(keys: str | None, key_file: str | None, named: Sequence[str] = ()) -> list[str]:
    """The tenants the settings' keys belong to, and those `named` (each checked); each
    may have a client on the bus (`tokenway.roles.client`). ValueError as `ApiKeys.load`."""
    found = {DEFAULT_TENANT} if keys else set()
    if key_file is not None:
        found |= {tenant for tenant, *_ in _read_key_file(key_file)}
    for name in named:
        if not TENANT.fullmatch(name):
            raise ValueError(
                f"tenant {name!r}: a tenant name is letters, digits, '_' and '-', "
                "up to 64, starting with a letter or digit"
            )
        found.add(name)
    return sorted(found)


def _open_paths(open_routes: str) -> frozenset[str]:
    names = {n.strip() for n in open_routes.split(",") if n.strip()} - {"none"}
    if unknown := names - OPTIONAL_OPEN.keys():
        raise ValueError(
            f"--open-routes: unknown {sorted(unknown)}; choose from {sorted(OPTIONAL_OPEN)} or none"
        )
    return frozenset(OPTIONAL_OPEN[n] for n in names)


def _read_key_file(
    key_file: str,
) -> Iterable[tuple[str, str, str, Limits | None, dict[str, int]]]:
    path = Path(key_file).expanduser()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {exc}") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"--api-key-file {path} line {number}"
        if len(fields) < 2 or not TENANT.fullmatch(fields[0]):
            # The line may hold a key: say what is wrong without showing it.
            raise ValueError(
                f"{where}: expected `TENANT KEY` (a tenant name of letters, "
                "digits, '_' and '-', up to 64; one key without spaces)"
            )
        limits, quota = _limits(fields[2:], where)
        found.append((fields[0], fields[1], where, limits, quota))
    if not found:
        raise ValueError(f"--api-key-file {path} holds no key")
    return found


def _limits(fields: list[str], where: str) -> tuple[Limits | None, dict[str, int]]:
    """`concurrent=N tokens_per_minute=N` (either, both; 0 is no limit; None: neither
    given) and the storage quota's shares given (`files_bytes=N`...; 0 is no limit)."""
    values: dict[str, int] = {}
    quota: dict[str, int] = {}
    for f in fields:
        name, _, value = f.partition("=")
        known = name in Limits.__struct_fields__ or name in Quota.__struct_fields__
        if not known or not value.isdigit():
            # Not echoed: a mistyped line may hold a second key.
            raise ValueError(
                f"{where}: after the key, expected limits as concurrent=N, "
                "tokens_per_minute=N, files_bytes=N, files_count=N, "
                "responses_bytes=N and responses_count=N only"
            )
        (values if name in Limits.__struct_fields__ else quota)[name] = int(value)
    return (Limits(**values) if values else None), quota
