"""Who turns a request into prompt tokens: the local tokenizer, or a vLLM render server.

`--render-backend local` renders with the model directory's tokenizer and chat template.
`--render-backend vllm` asks the render server at `--render-url`; when the server cannot be
used (no connection, timeout, 5xx, an answer that is not a usable prompt) the request is
rendered locally instead, with a warning and a count in `tokenway_render_fallbacks_total`.
The local tokenizer is loaded on the first fallback (or `/tokenize` call), not before. A
400/422 is the request's own error: it goes to the client with the server's message and
status, and is not retried.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Protocol, TypeVar

from prometheus_client import Counter
from tokenizers import Tokenizer

from tokenway import heap
from tokenway.aio import on_big_stack
from tokenway.api.openai import CompletionRequest, OpenAIRequest
from tokenway.config import Settings
from tokenway.limits import RequestLimits
from tokenway.model import ModelInfo
from tokenway.wire import Api, GenerateRequest, RenderRequest
from workers.render.core import Parsed, Renderer, RequestBuilder, completion_prompts
from workers.render.parse import ParserFlags
from workers.render.vllm_http import RenderUnavailable, VllmRenderClient

log = logging.getLogger(__name__)
T = TypeVar("T")

FALLBACKS = Counter(
    "tokenway_render_fallbacks",
    "Requests rendered by the local tokenizer because the render server could not be used",
    ["reason"],
)


class RenderBackend(Protocol):
    async def render(self, request: RenderRequest) -> GenerateRequest: ...

    async def local(self) -> Renderer:
        """The local tokenizer and template (`/tokenize`, fallbacks)."""
        ...

    async def aclose(self) -> None: ...


# A body above this is templated and tokenized in a thread: the fast tokenizer lets go of
# the GIL while it works, so the event loop, and every stage sharing it (the ingress's
# streams beside it, all of `tokenway up`'s), goes on meanwhile. Measured on one loop with
# a 0.5 ms ticker: a 16 KiB chat held the loop 8 ms inline and 1 ms from a thread, a 64 KiB
# one 63 ms and 2 ms; the thread costs 0.2 ms at 4 KiB and nothing above 16.
THREAD_ABOVE_BYTES = 4 * 1024
# Above this, what the work freed is also given back to the system (`tokenway.heap`).
GIVE_BACK_ABOVE_BYTES = 64 * 1024


async def worked(size: int, work: Callable[..., T], *args: object) -> T:
    """`work(*args)` for a body of `size` bytes: in a thread when the body is not small,
    and what a big one freed then given back to the system."""
    if size > GIVE_BACK_ABOVE_BYTES:
        return await asyncio.to_thread(_given_back, work, *args)
    if size > THREAD_ABOVE_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)


def _given_back(work: Callable[..., T], *args: object) -> T:
    try:
        return work(*args)
    except BaseException as exc:
        # A refusal's traceback keeps the frames that raised it, and their locals (the
        # prompt's millions of ids) with them: cleared now, or the trim below runs while
        # they are alive and they are freed after it, kept by the allocator.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        heap.give_back()


async def parsing(builder: RequestBuilder, request: RenderRequest) -> Parsed:
    """The request decoded and checked, its constraint compiled to see that it compiles: off
    the event loop (a large schema compiles for seconds) and on a big stack (a grammar can
    make the compiler recurse as deep as its rules chain)."""
    return await on_big_stack(builder.parse, request)


async def prompt_ids(
    renderer: Renderer, req: OpenAIRequest, size: int, api: Api | None = None
) -> list[list[int]]:
    """The request's prompt IDs, off the event loop for a body of `size` bytes that is big."""
    return await worked(size, renderer.prompt_ids, req, api)


class LocalBackend:
    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer

    async def render(self, request: RenderRequest) -> GenerateRequest:
        builder = self.renderer.builder
        if request.api == "generate":  # token IDs already: nothing to render
            return await on_big_stack(builder.generate, request)
        parsed = await parsing(builder, request)
        ids = await prompt_ids(self.renderer, parsed.req, len(request.body), request.api)
        return builder.build(request, parsed, ids, self.renderer.vocab)

    async def local(self) -> Renderer:
        return self.renderer

    async def aclose(self) -> None:
        pass


class _VocabFile(Mapping[str, int]):
    """The vocabulary from tokenizer.json, read on the first lookup (a reasoning marker's id):
    the fast tokenizer's file only, not transformers' tokenizer and template."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @cached_property
    def _vocab(self) -> dict[str, int]:
        return Tokenizer.from_file(str(self.path)).get_vocab(with_added_tokens=True)

    def __getitem__(self, token: str) -> int:
        return self._vocab[token]

    def __iter__(self) -> Iterator[str]:
        return iter(self._vocab)

    def __len__(self) -> int:
        return len(self._vocab)


class VllmBackend:
    """Render through a vLLM render server, falling back to the local tokenizer."""

    def __init__(self, builder: RequestBuilder, client: VllmRenderClient) -> None:
        self.builder = builder
        self.client = client
        self.vocab = _VocabFile(builder.info.path / "tokenizer.json")
        self._local: Renderer | None = None
        self._loading = asyncio.Lock()

    @property
    def local_loaded(self) -> bool:
        return self._local is not None

    async def render(self, request: RenderRequest) -> GenerateRequest:
        if request.api == "generate":  # token IDs already: nothing to render
            return await on_big_stack(self.builder.generate, request)
        parsed = await parsing(self.builder, request)
        req = parsed.req
        if isinstance(req, CompletionRequest) and len(completion_prompts(req)) > 1:
            # vLLM's render route answers one prompt; several are tokenized here.
            local = await self.local()
            ids = await prompt_ids(local, req, len(request.body), request.api)
            return self.builder.build(request, parsed, ids, local.vocab)
        try:
            prompt = await self.client.render(request.api, request.body)
        except RenderUnavailable as exc:
            FALLBACKS.labels(exc.reason).inc()
            log.warning(
                "render server failed for %s (%s); rendering locally", request.request_id, exc
            )
            local = await self.local()
            ids = await prompt_ids(local, req, len(request.body), request.api)
            return self.builder.build(request, parsed, ids, local.vocab)
        return self.builder.build(
            request, parsed, [prompt.token_ids], self.vocab, prompt.sampling_params
        )

    async def local(self) -> Renderer:
        """Loaded once, off the event loop (transformers takes a second or two)."""
        async with self._loading:
            if self._local is None:
                b = self.builder
                self._local = await asyncio.to_thread(
                    Renderer, b.info, b.model, b.flags, b.clip_budget, b.limits
                )
                log.info("loaded the local tokenizer for render fallbacks")
        return self._local

    async def aclose(self) -> None:
        await self.client.aclose()


def render_backend(
    settings: Settings, model: ModelInfo, served_model_name: str, flags: ParserFlags
) -> RenderBackend:
    """The backend `--render-backend` names; ValueError when its settings do not fit."""
    clip = settings.context_budget == "on"
    limits = RequestLimits.of(settings)
    if settings.render_backend == "local":
        return LocalBackend(Renderer(model, served_model_name, flags, clip, limits))
    if not settings.render_url:
        raise ValueError("--render-backend vllm needs --render-url (the vLLM render server)")
    client = VllmRenderClient(
        settings.render_url,
        model.vocab_size,
        settings.render_connect_timeout,
        settings.render_timeout,
    )
    return VllmBackend(RequestBuilder(model, served_model_name, flags, clip, limits), client)
