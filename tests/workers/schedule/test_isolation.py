"""What a request may ask of engines other tenants share: its cache salt, its KV params."""

from __future__ import annotations

import pytest

from tokenway.errors import InvalidRequest
from workers.schedule.isolation import MAX_SALT, cache_salt, check_kv_transfer, check_salt


def test_each_tenants_salt_is_its_own_and_no_client_salt_can_name_anothers() -> None:
    acme, rival = cache_salt("acme", None, False), cache_salt("rival", None, False)
    assert acme and rival and acme != rival
    assert cache_salt("acme", None, False) == acme  # one tenant's requests share its cache
    mixed = {cache_salt(t, s, False) for t in ("acme", "rival", "") for s in ("team", acme)}
    assert len(mixed) == 6 and acme not in mixed and rival not in mixed
    assert all(len(s) <= MAX_SALT and s.isalnum() for s in mixed)  # vLLM takes it


def test_without_tenants_or_where_they_share_the_salt_is_the_clients() -> None:
    assert cache_salt("", None, False) is None  # a keyless prompt shares the cache as before
    assert cache_salt("acme", None, True) is None and cache_salt("acme", "s", True) == "s"
    assert cache_salt("", "s", False) not in (None, "s")  # kept apart, but no tenant's


@pytest.mark.parametrize("salt", ["", "a/b", "user@host", "x" * (MAX_SALT + 1), "nul\0"])
def test_a_salt_vllm_refuses_is_the_clients_400(salt: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_salt(salt)
    assert refused.value.info().param == "cache_salt"


def test_kv_transfer_params_are_refused_from_a_tenant_unless_trusted() -> None:
    kv = {"remote_block_ids": [1], "remote_engine_id": "p0"}
    with pytest.raises(InvalidRequest) as refused:
        check_kv_transfer(kv, "acme", trusted=False)
    info = refused.value.info()
    assert info.param == "kv_transfer_params" and "remote_block_ids" in info.message
    check_kv_transfer(kv, "acme", trusted=True)
    check_kv_transfer(kv, "", trusted=False)  # keyless: as it was
    check_kv_transfer(None, "acme", trusted=False)
