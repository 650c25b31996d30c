"""What the README says of the ingress's metrics holds for the code."""

from __future__ import annotations

from pathlib import Path

from ingress.completions import ROUTES
from ingress.metrics import OTHER


def test_the_readme_names_every_api_label_of_the_requests_counter() -> None:
    """The README lists the `api` label's values: each route's, and `other`."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    sentence = readme[readme.index("`tokenway_requests_total{api,status}`") :].split(")", 1)[0]
    for api in {*ROUTES.values(), OTHER}:
        assert f"`{api}`" in sentence, api
