"""Several models in one deployment: the bundled tokenizer as `alpha`, and a copy of it with
another chat template and context length as `beta`, served side by side."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from program.stages import build_stages, serve
from tests.conftest import Stack, make_settings, start_stack, wait_engines
from tokenway.config import Settings
from tokenway.model import default_model_dir

pytestmark = pytest.mark.asyncio(loop_scope="session")

BETA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = [{"role": "user", "content": "Which model are you?"}]


def beta_dir(data_dir: Path, into: Path) -> Path:
    """The bundled model directory with its own chat template and a 4096-token context."""
    beta = into / "beta"
    shutil.copytree(default_model_dir(data_dir), beta)
    config = json.loads((beta / "config.json").read_text())
    (beta / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    tokenizer_config = json.loads((beta / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = BETA_TEMPLATE
    (beta / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return beta


class Models:
    def __init__(self, stack: Stack, settings: Settings, beta: Path) -> None:
        self.stack, self.settings, self.beta = stack, settings, beta
        self.engines: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start_engine(self, model: str) -> None:
        """A simulated engine for `model` alone, as `tokenway engine sim` would run it."""
        only = msgspec.structs.replace(self.settings, models=f"{model}={self.beta}"
                                       if model == "beta" else model)  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(serve(only, build_stages(only, ["sim"]), stop))
        self.engines.append((stop, task))
        await wait_engines(self.stack.ingress.registry, 1, model=model)


@pytest_asyncio.fixture(loop_scope="session")
async def models(nats_url: str, tmp_path: Path) -> AsyncIterator[Models]:
    data = tmp_path / "data"
    beta = beta_dir(data, tmp_path)
    settings = make_settings(data, nats=nats_url, models=f"alpha,beta={beta}")
    stack = await start_stack(nats_url, settings, ["ingress", "render", "schedule"])
    deployment = Models(stack, settings, beta)
    yield deployment
    for stop, task in deployment.engines:
        stop.set()
        await task
    await stack.close()


async def test_two_models_render_with_their_own_templates_and_list_once_engines_serve_them(
    models: Models,
) -> None:
    tokenizer = Tokenizer.from_file(str(models.beta / "tokenizer.json"))
    beta_prompt = tokenizer.encode("user: Which model are you?\nassistant:",
                                   add_special_tokens=False).ids  # fmt: skip
    await models.start_engine("alpha")
    async with httpx.AsyncClient(base_url=models.stack.url, timeout=60) as http:
        listed = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in listed] == [("alpha", 131072)]
        assert listed[0]["root"] == str(default_model_dir(Path(models.settings.data_dir)))
        # served, its engine not there yet: its card, but not in the list
        card = (await http.get("/v1/models/beta")).json()
        assert (card["id"], card["max_model_len"], card["root"]) == ("beta", 4096, str(models.beta))
        await models.start_engine("beta")
        listed = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["alpha", "beta"]

        client = openai.AsyncOpenAI(base_url=f"{models.stack.url}/v1", api_key="-")
        answers = {}
        for name in ("alpha", "beta"):
            answers[name] = await client.chat.completions.create(
                model=name, messages=CHAT, max_tokens=4, extra_body={"return_token_ids": True}
            )
            assert answers[name].model == name
        assert answers["beta"].prompt_token_ids == beta_prompt  # type: ignore[attr-defined]
        assert answers["alpha"].prompt_token_ids != beta_prompt  # type: ignore[attr-defined]

        tokenized = (await http.post("/tokenize", json={"model": "beta", "messages": CHAT})).json()
        assert (tokenized["tokens"], tokenized["max_model_len"]) == (beta_prompt, 4096)
        # a request naming no model is the first model's, as in vLLM
        default = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        assert default.status_code == 200 and default.json()["model"] == "alpha", default.text

        with pytest.raises(openai.NotFoundError, match="gamma"):
            await client.chat.completions.create(model="gamma", messages=CHAT, max_tokens=2)
        unknown = await http.post("/tokenize", json={"model": "gamma", "prompt": "hi"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        assert (await http.get("/v1/models/gamma")).status_code == 404
