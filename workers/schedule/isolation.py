"""What a request may ask of engines that other tenants' requests share (pure).

Where requests carry a tenant (API keys, or a tenant's direct client), one tenant's request
must not reach another tenant's work through an engine:

- `kv_transfer_params` name KV blocks on other engines (vLLM's NIXL connector: a decode
  engine pulls `remote_block_ids` from the prefill engine `remote_engine_id` at
  `remote_host:remote_port`, and tells it `remote_request_id` is done with them). A client's
  could make a decode engine continue from blocks holding another tenant's prompt, or free
  another request's blocks before its own decode pulls them. They are refused unless the
  deployment trusts its clients (`--trust-client-kv-transfer`: an external P/D coordinator
  sends them). A keyless deployment passes them on, as it always did.
- Engines' prefix caches are shared, and a prompt that hits another's cached blocks starts
  sooner: a client timing its first token learns whether another tenant sent a prefix (a
  known prompt-leak attack, which vLLM answers with `cache_salt`). Each tenant's requests
  are salted apart, the client's own salt mixed in, unless the tenants share the cache
  (`--share-prefix-cache`). The owner's affinity index hashes the same salt, so it never
  counts one tenant's blocks as cached for another either.
"""

from __future__ import annotations

import hashlib

import msgspec

from tokenway.errors import InvalidRequest

# vLLM 0.33 refuses a cache_salt that is empty, longer than this, or holds one of these.
MAX_SALT = 128
_FORBIDDEN = frozenset("@/\\\0")


def cache_salt(tenant: str, salt: str | None, shared: bool) -> str | None:
    """The salt the engines' prefix caches see for a request of `tenant` (`""`: none) that
    asked for `salt`: of that tenant and that salt only, a digest no other tenant's salt
    can equal. An unsalted request without a tenant, or any where tenants share the cache,
    keeps what it asked for."""
    check_salt(salt)
    if shared or (not tenant and salt is None):
        return salt
    return hashlib.blake2b(msgspec.msgpack.encode([tenant, salt]), digest_size=16).hexdigest()


def check_salt(salt: str | None) -> None:
    """vLLM's rule for a client's cache_salt (its 400), checked before the salt is mixed."""
    if salt is None:
        return
    if not salt or len(salt) > MAX_SALT or _FORBIDDEN.intersection(salt):
        raise InvalidRequest(
            f"cache_salt must be a non-empty string of at most {MAX_SALT} characters without "
            f"'@', '/', '\\' or NUL, not {salt[: MAX_SALT + 8]!r}",
            param="cache_salt",
        )


def check_kv_transfer(kv: dict[str, object] | None, tenant: str, trusted: bool) -> None:
    """A tenant's request may not name KV blocks on the engines, unless clients are trusted."""
    if kv is None or not tenant or trusted:
        return
    raise InvalidRequest(
        f"kv_transfer_params (with {', '.join(sorted(kv)) or 'no fields'}) are not taken from "
        "a tenant's request: they name KV blocks on the engines, which may hold another "
        "tenant's prompt (a deployment whose clients are trusted P/D coordinators allows "
        "them with --trust-client-kv-transfer)",
        param="kv_transfer_params",
    )
