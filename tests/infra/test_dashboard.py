"""The Grafana dashboard queries only metrics tokenway exports."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "tokenway.json"
_NAME = re.compile(r"\b(tokenway[:_][a-z0-9_:]+)")


# What registers metrics on the process's registry: render fallbacks, request families, stages,
# the ingress's answers.
MODULES = ("workers.render.backend", "workers.schedule.metrics", "tokenway.metrics",
           "ingress.metrics")  # fmt: skip


def exported() -> set[str]:
    for module in MODULES:
        importlib.import_module(module)
    names = set()
    for family in REGISTRY.collect():
        names |= {sample.name for sample in family.samples} | {family.name}
    # a histogram's samples exist per label set only once observed: name them all
    names |= {f"{n}{part}" for n in names for part in ("_bucket", "_count", "_sum", "_total")}
    return names


def test_every_dashboard_query_names_an_exported_metric() -> None:
    doc = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in doc["panels"] for t in panel["targets"]]
    queries += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    used = {name for q in queries for name in _NAME.findall(q)}
    assert used, "the dashboard queries nothing"
    assert used <= exported(), used - exported()
