"""Render's pure core: an OpenAI request body → a tokenized `GenerateRequest`."""

from __future__ import annotations

from pathlib import Path

import msgspec
from transformers import AutoTokenizer

from tokenway.errors import InvalidRequest, ModelNotFound
from tokenway.model import ModelInfo
from tokenway.protocol import (
    ChatCompletionRequest,
    ChatDecoder,
    CompletionDecoder,
    CompletionRequest,
)
from tokenway.wire import (
    MAX_PROMPTS,
    GenerateRequest,
    OutputContext,
    Prompt,
    RenderRequest,
    StreamOptions,
)
from workers.derender.detok import SEED_TOKENS
from workers.render.chat import apply_template
from workers.render.parse import ParserFlags, parse_context
from workers.render.sampling import (
    budget,
    reject_unsupported,
    requested_max_tokens,
    sampling_params,
)


def decode_body(api: str, body: bytes) -> ChatCompletionRequest | CompletionRequest:
    """Validate an OpenAI body; a malformed one is the client's 400."""
    try:
        return (ChatDecoder if api == "chat" else CompletionDecoder).decode(body)
    except msgspec.ValidationError as exc:
        param = str(exc).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(exc) else None
        raise InvalidRequest(f"invalid request: {exc}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc


class Renderer:
    def __init__(
        self,
        model: ModelInfo,
        served_model_name: str,
        flags: ParserFlags | None = None,
        clip_budget: bool = False,
    ) -> None:
        self.info = model
        self.clip_budget = clip_budget
        self.model = served_model_name
        self.flags = flags or ParserFlags()
        self.tokenizer = AutoTokenizer.from_pretrained(str(Path(model.path)))
        self.vocab_size = len(self.tokenizer)
        self.vocab = self.tokenizer.get_vocab()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise ModelNotFound(
                f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Every prompt of a completions request as token IDs: one text or ID list, or a
        list of several (texts or ID lists)."""
        prompt = req.prompt
        several = isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt)
        prompts = prompt if several else [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequest(
                f"{len(prompts)} prompts in one request, over the {MAX_PROMPTS} limit",
                param="prompt",
            )
        return [self._prompt(p, req.add_special_tokens) for p in prompts]  # type: ignore[arg-type]

    def _prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, list):
            raise InvalidRequest(
                f"a list of prompts holds a bare token id ({prompt}); give each prompt as a "
                "text or a list of token IDs",
                param="prompt",
            )
        if not prompt:
            raise InvalidRequest("prompt is empty", param="prompt")
        bad = next((t for t in prompt if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary", param="prompt")
        return list(prompt)

    def render(self, request: RenderRequest) -> GenerateRequest:
        req = decode_body(request.api, request.body)
        self.check_model(req.model)
        reject_unsupported(req)
        parse, more = None, []
        if isinstance(req, ChatCompletionRequest):
            text = apply_template(self.tokenizer, req)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prefix, field = "chatcmpl", "messages"
            parse = parse_context(req, ids, self.flags, self.vocab)
        else:
            ids, *more = self._prompts(req)
            prefix, field = "cmpl", "prompt"
        if not ids or not all(more):
            raise InvalidRequest("the prompt is empty after rendering", param=field)
        max_tokens = self._budget(ids, req)
        prompts = None
        if more:  # several prompts: each its own budget, as vLLM gives each its own
            prompts = [Prompt(token_ids=p, max_tokens=self._budget(p, req)) for p in [ids, *more]]
        params = sampling_params(req, max_tokens)
        opts = req.stream_options
        context = OutputContext(
            api=request.api,
            response_id=f"{prefix}-{req.request_id or request.request_id}",
            model=self.model,
            created=request.created,
            prompt_tokens=len(ids),
            prompt_tail=ids[-SEED_TOKENS:],
            stream=bool(req.stream),
            include_usage=bool(opts and opts.include_usage),
            continuous_usage_stats=bool(opts and opts.continuous_usage_stats),
            echo=isinstance(req, CompletionRequest) and bool(req.echo),
            return_token_ids=bool(req.return_token_ids),
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            stop=params.stop,
            min_tokens=params.min_tokens,
            n=params.n,
            logprobs=params.logprobs,
            parse=parse,
        )
        return GenerateRequest(
            request_id=request.request_id,
            token_ids=ids,
            sampling_params=params,
            model=self.model,
            stream=bool(req.stream),
            stream_options=StreamOptions(
                include_usage=context.include_usage,
                continuous_usage_stats=context.continuous_usage_stats,
            )
            if opts
            else None,
            priority=req.priority,
            cache_salt=req.cache_salt,
            kv_transfer_params=req.kv_transfer_params,
            return_token_ids=req.return_token_ids,
            context=context,
            prompts=prompts,
        )

    def _budget(self, ids: list[int], req: ChatCompletionRequest | CompletionRequest) -> int:
        return budget(
            len(ids), requested_max_tokens(req), self.info.context_length, self.clip_budget
        )
