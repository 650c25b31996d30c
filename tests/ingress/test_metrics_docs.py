"""What docs/observability.md says of the ingress's metrics holds for the code."""

from __future__ import annotations

from pathlib import Path

from ingress.completions import ROUTES
from ingress.metrics import OTHER


def test_the_readme_names_every_api_label_of_the_requests_counter() -> None:
    """docs/observability.md lists the `api` label's values: each route's, and `other`."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    sentence = readme[readme.index("`tokenway_requests_total{api,status}`") :].split(")", 1)[0]
    for api in {*ROUTES.values(), OTHER}:
        assert f"`{api}`" in sentence, api
