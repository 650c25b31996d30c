"""Who derenders: the local detokenizer and parsers, or a vLLM derender server.

`--derender-backend local` runs `core.derender_call` in the worker. `--derender-backend vllm`
sends every entry to the server at `--derender-url` (default `--render-url`), one call per
entry, concurrently. There is no fallback to local derender: a stream's state is the
server's, which the local core cannot continue (nor the other way round), so a failing
server fails the request with 502/504 and a refusal (400/422) reaches the client with the
server's message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from tokenway.config import Settings
from tokenway.derendering import Derenderer, is_large
from tokenway.errors import StageUnavailable, TokenwayError, internal
from tokenway.model import tokenizer_of
from tokenway.wire import Derendered, DerenderEntry, DerenderFailed, DerenderResult
from workers.derender import vllm_http as v
from workers.derender.core import derender_call, merge_choices, tokens_out
from workers.derender.detok import Detokenizer

log = logging.getLogger(__name__)


class LocalBackend:
    awaits_io = False

    def __init__(self, model_dir: Path) -> None:
        self.detok = Detokenizer(tokenizer_of(model_dir))

    async def derender(self, entries: Sequence[DerenderEntry]) -> list[DerenderResult]:
        """In the caller's loop, or in a thread for a large call (the core shares no state)."""
        if is_large(entries):
            return await asyncio.to_thread(derender_call, self.detok, entries)
        return derender_call(self.detok, entries)

    async def aclose(self) -> None:
        pass


class VllmBackend:
    awaits_io = True

    def __init__(self, client: v.VllmDerenderClient) -> None:
        self.client = client

    async def derender(self, entries: Sequence[DerenderEntry]) -> list[DerenderResult]:
        results = await asyncio.gather(*(self._one(entry) for entry in entries))
        return merge_choices(entries, list(results))

    async def _one(self, entry: DerenderEntry) -> DerenderResult:
        try:
            return await self._derender(entry)
        except TokenwayError as exc:
            return DerenderFailed(error=exc.info())
        except Exception:  # a bug must still answer the caller
            log.exception("derendering %s failed", entry.context.response_id)
            return DerenderFailed(error=internal(entry.context.response_id))

    async def _derender(self, entry: DerenderEntry) -> Derendered:
        ctx = entry.context
        if ctx.api == "generate":  # token IDs out: nothing for the server to decode
            return tokens_out(entry)
        if entry.usage_total is not None:  # the closing usage chunk of n > 1 choices
            if not ctx.closing_usage:
                return Derendered()
            return Derendered(chunks=[await self._usage(entry, entry.usage_total)])
        if not ctx.stream:
            content = await self.client.post(ctx, v.once_call(entry))
            return Derendered(chunks=[v.read_response(ctx, content)])
        state = v.carried(entry.state) if entry.state is not None else None
        tokens = (state.tokens if state else 0) + len(entry.token_ids)
        continuous = ctx.include_usage and ctx.continuous_usage_stats
        chunk = v.generate_chunk(entry, v.usage(ctx, tokens) if continuous else None)
        content = await self.client.post(
            ctx, v.stream_call(ctx, chunk, state.vllm if state else None)
        )
        doc, vllm_state = v.read_stream_reply(ctx, content)
        docs = [doc] if doc is not None else []
        if entry.finish_reason is not None and ctx.include_usage and ctx.closing_usage:
            if ctx.n == 1:  # with n > 1 the owner asks for the summed usage at the end
                docs.append(await self._usage(entry, tokens))
        return Derendered(chunks=docs, state=v.carry(tokens, vllm_state))

    async def _usage(self, entry: DerenderEntry, tokens: int) -> bytes:
        """The closing usage chunk, asked of the server as the generate route's last chunk."""
        ctx = entry.context
        content = await self.client.post(ctx, v.stream_call(ctx, v.usage_chunk(ctx, tokens), None))
        doc, _ = v.read_stream_reply(ctx, content)
        if doc is None:
            raise StageUnavailable("the derender server's usage chunk holds no usage")
        return doc

    async def aclose(self) -> None:
        await self.client.aclose()


def derender_backend(settings: Settings, model_dir: Path) -> Derenderer:
    """The backend `--derender-backend` names; ValueError when its settings do not fit."""
    if settings.derender_backend == "local":
        return LocalBackend(model_dir)
    url = settings.derender_url or settings.render_url
    if not url:
        raise ValueError(
            "--derender-backend vllm needs --derender-url or --render-url (the vLLM server)"
        )
    if settings.derender_server_timeout >= settings.derender_timeout:
        raise ValueError(
            f"--derender-server-timeout ({settings.derender_server_timeout}s) must be below "
            f"the owner's derender timeout ({settings.derender_timeout}s), or the owner "
            "gives up before the server's failure can be reported"
        )
    client = v.VllmDerenderClient(
        url,
        settings.derender_connect_timeout,
        settings.derender_server_timeout,
        settings.derender_retries,
        settings.derender_timeout,
    )
    return VllmBackend(client)
