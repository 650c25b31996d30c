"""One metrics page per process: an ingress's --metrics-port page and its API's /metrics show
the same families, the ingress's own and every stage's in the process."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.stages import stage_processes
from tests.test_cli import free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")


def families(page: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(page)}


async def test_the_metrics_port_page_is_the_api_page(nats_url: str, tmp_path: Path) -> None:
    async with stage_processes(nats_url, tmp_path, "ingress", 0) as c:
        port, metrics = free_port(), free_port()
        # on every interface, as a container's scraper needs it
        await c.spawn("ingress", "--port", str(port),
                      "--metrics-port", str(metrics), "--metrics-host", "0.0.0.0")  # fmt: skip
        api = f"http://127.0.0.1:{port}"
        chat = openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="-", max_retries=0)
        stream = await chat.chat.completions.create(
            model=c.stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True,
        )  # fmt: skip
        assert [chunk async for chunk in stream]
        async with httpx.AsyncClient() as client:
            port_page = families((await client.get(f"http://127.0.0.1:{metrics}/metrics")).text)
            api_page = families((await client.get(f"{api}/metrics")).text)
    for name in ("tokenway_requests", "tokenway_active_streams", "tokenway_stage_seconds",
                 "tokenway_bodies_waiting", "tokenway_bus_errors"):  # fmt: skip
        assert name in port_page and name in api_page, name
    assert set(port_page) == set(api_page)
    served = [s for s in port_page["tokenway_requests"] if s.labels.get("api") == "chat"]
    assert served and served[0].value >= 1, port_page["tokenway_requests"]
