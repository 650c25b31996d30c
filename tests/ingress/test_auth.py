"""API keys: how they are read, kept and checked (`ingress.auth`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ingress.auth import ApiKeys, Unauthorized
from tokenway.config import load_settings
from tokenway.quota import Quota
from tokenway.tenancy import Limits

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
KEY_DEFAULT = "sk-default-0123456789abcdef"


def test_keys_are_kept_only_as_digests(tmp_path: Path) -> None:
    keys = ApiKeys.load(KEY_DEFAULT, None, "")
    assert KEY_DEFAULT.encode() not in repr(keys).encode()
    assert keys.tenant("/v1/models", f"Bearer {KEY_DEFAULT}".encode()) == "default"
    assert keys.tenant("/v1/models", f"bearer   {KEY_DEFAULT} ".encode()) == "default"
    assert keys.tenant("/health", b"") == ""
    with pytest.raises(Unauthorized):
        keys.tenant("/metrics", b"")  # `none` of the optional routes is open here


def test_no_key_configured_opens_every_route() -> None:
    keys = ApiKeys.load(None, None, "ready,metrics")
    assert keys.tenant("/v1/completions", b"") == ""


@pytest.mark.parametrize(
    "text, why",
    [
        (f"acme {KEY_A} extra\n", "expected limits as concurrent=N"),
        (f"acme {KEY_A} concurrent=-1\n", "expected limits as concurrent=N"),
        (f"acme {KEY_A} concurrent=2\nacme {KEY_B} concurrent=3\n", "other limits"),
        (f"{KEY_A}\n", "expected `TENANT KEY`"),
        (f"ac/me {KEY_A}\n", "expected `TENANT KEY`"),
        (f"acme {KEY_A}\nglobex {KEY_A}\n", "given to two tenants"),
        ("# nothing\n\n", "holds no key"),
    ],
)
def test_an_unusable_key_file_refuses_without_showing_a_key(
    tmp_path: Path, text: str, why: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=why) as raised:
        ApiKeys.load(None, str(path), "")
    assert KEY_A not in str(raised.value) and KEY_A[:10] not in str(raised.value)


def test_a_set_but_empty_key_variable_refuses_to_start(tmp_path: Path) -> None:
    """An empty TOKENWAY_API_KEY is a secret gone missing, never an open API."""
    s = load_settings({}, {"TOKENWAY_API_KEY": "", "TOKENWAY_DATA_DIR": str(tmp_path)})
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.load(s.api_key, s.api_key_file, s.open_routes)
    with pytest.raises(ValueError, match="unknown"):
        ApiKeys.load(KEY_A, None, "ready,docs")


def test_a_short_key_is_warned_about_without_showing_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        ApiKeys.load("short-key", None, "")
    assert "9 characters" in caplog.text and "short-key" not in caplog.text


def test_limits_are_a_tenants_shared_by_its_keys_or_else_the_default(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"acme {KEY_A} concurrent=2 tokens_per_minute=9000\nacme {KEY_B}\n"
                    f"globex sk-globex-0123456789abcdef tokens_per_minute=0\n")  # fmt: skip
    keys = ApiKeys.load(KEY_DEFAULT, str(path), "", Limits(concurrent=5))
    assert keys.limits == {
        "acme": Limits(concurrent=2, tokens_per_minute=9000),  # both its keys
        "default": Limits(concurrent=5),  # --tenant-concurrency
    }  # globex set its own: none
    assert ApiKeys.load(KEY_DEFAULT, None, "").limits == {}


def test_a_storage_quota_is_a_tenants_each_share_unsaid_being_the_default(tmp_path: Path) -> None:
    """A line's `files_bytes=` and the like set the tenant's share of the stores; a share it
    does not give (or a line giving none, or `--api-key`'s tenant) is the default's, and a
    storage share leaves the rate limits as they were."""
    path = tmp_path / "keys"
    path.write_text(f"acme {KEY_A} files_bytes=5000 responses_count=7\nacme {KEY_B}\n"
                    f"globex sk-globex-0123456789abcdef files_count=0 concurrent=3\n")  # fmt: skip
    default = Quota(files_bytes=100, files_count=10, responses_bytes=50, responses_count=5)
    keys = ApiKeys.load(KEY_DEFAULT, str(path), "", Limits(concurrent=5), default)
    assert keys.quota("acme") == Quota(files_bytes=5000, files_count=10, responses_bytes=50,
                                       responses_count=7)  # fmt: skip
    assert keys.quota("globex") == Quota(files_bytes=100, files_count=0, responses_bytes=50,
                                         responses_count=5)  # fmt: skip
    assert keys.quota("default") == keys.quota("") == default  # keyless: one shared quota
    assert keys.limits["acme"] == Limits(concurrent=5)  # no rate limit given: the default's
    assert keys.limits["globex"] == Limits(concurrent=3)
    path.write_text(f"acme {KEY_A} files_bytes=1\nacme {KEY_B} files_bytes=2\n")
    with pytest.raises(ValueError, match="other limits"):
        ApiKeys.load(None, str(path), "")
    path.write_text(f"acme {KEY_A} files_bytes=-1\n")
    with pytest.raises(ValueError, match="files_bytes=N") as raised:
        ApiKeys.load(None, str(path), "")
    assert KEY_A not in str(raised.value)
