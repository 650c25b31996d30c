"""The CORS policy the settings make."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingress.cors import Cors
from tests.conftest import make_settings


def test_the_policy_reads_lists_as_vllm_and_as_commas_and_refuses_credentials_for_all(
    tmp_path: Path,
) -> None:
    def load(**overrides: object) -> Cors | None:
        return Cors.load(make_settings(tmp_path, **overrides))

    assert load() is None
    json_list = load(allowed_origins='["https://a.example", "https://b.example"]')
    commas = load(allowed_origins="https://a.example, https://b.example")
    assert json_list == commas and commas is not None
    assert commas.origins == ["https://a.example", "https://b.example"]
    assert commas.methods == ["*"] and not commas.credentials
    with pytest.raises(ValueError, match="every web site"):
        load(allowed_origins="*", allow_credentials=True)
    with pytest.raises(ValueError, match="JSON list"):
        load(allowed_origins='["https://a.example"')
