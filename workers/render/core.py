"""Render's pure core: an OpenAI request body → a tokenized `GenerateRequest`.

`RequestBuilder` is everything render does without a tokenizer (decoding and validating the
body, the budget, the output context); `Renderer` adds the local tokenizer and chat template.
A remote renderer (`workers/render/backend.py`) supplies the prompt tokens in its place.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenway import parsers, token_only
from tokenway.api import generate as generate_api
from tokenway.api import responses
from tokenway.api.anthropic import MESSAGE_ID_PREFIX
from tokenway.api.bodies import decode_body
from tokenway.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
)
from tokenway.api.responses import RESPONSE_ID_PREFIX
from tokenway.constraints import check
from tokenway.errors import InvalidRequest, check_model
from tokenway.limits import DEFAULT_LIMITS, RequestLimits
from tokenway.model import ModelInfo
from tokenway.parsers import ParserFlags
from tokenway.sampling import budget, output_options
from tokenway.wire import (
    MAX_PROMPTS,
    SEED_TOKENS,
    Api,
    GenerateRequest,
    OutputContext,
    ParseContext,
    Prompt,
    RenderRequest,
    SamplingParams,
    StreamOptions,
    StructuredOutputs,
)
from workers.render import harmony, structured
from workers.render.chat import apply_template
from workers.render.parse import call_tags, check_tool_choice, keeps_special_tokens, parse_context
from workers.render.sampling import (
    keep_output_fields,
    reject_unsupported,
    requested_max_tokens,
    sampling_params,
)
from workers.render.token_floor import TokenFloor


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Every prompt of a completions request, checked for shape: one text or ID list, or a
    list of several (texts or ID lists)."""
    prompt = req.prompt
    several = isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if several else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(
            f"{len(prompts)} prompts in one request, over the {MAX_PROMPTS} limit",
            param="prompt",
        )
    for p in prompts:
        if not isinstance(p, (str, list)):
            raise InvalidRequest(
                f"a list of prompts holds a bare token id ({p}); give each prompt as a "
                "text or a list of token IDs",
                param="prompt",
            )
        if not p:
            raise InvalidRequest("prompt is empty", param="prompt")
    return prompts  # type: ignore[return-value]


def reasoning_ended(
    req: OpenAIRequest, parser: str | None, prompt_ids: Sequence[int], vocab: Mapping[str, int]
) -> bool | None:
    """Whether a constraint applies from the first output token, as vLLM tells its engine:
    reasoning is not shown, or the prompt leaves none open (`parsers.prompt_ends_reasoning`);
    None without a reasoning parser (and for completions: the engine judges from the
    prompt)."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    if not req.include_reasoning:
        return True
    if parser is None:
        return None
    kwargs = req.chat_template_kwargs or {}
    return parsers.prompt_ends_reasoning(parser, prompt_ids, kwargs, vocab)


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request body decoded and checked, with the constraint it asks for."""

    req: OpenAIRequest
    constraint: StructuredOutputs | None


# A response's id: vLLM's prefixes, and Anthropic's for a Messages request.
_ID_PREFIXES = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "messages": MESSAGE_ID_PREFIX,
    "responses": RESPONSE_ID_PREFIX,
}


def _param(api: Api, name: str) -> str:
    """A parameter of the request render reads, by the name the client's API gives it (a
    Responses request runs as the chat request it is)."""
    return responses.CHAT_PARAMS.get(name, name) if api == "responses" else name


@dataclass(frozen=True)
class RequestBuilder:
    """What render decides without a tokenizer: validation, the budget, the output context."""

    info: ModelInfo
    model: str  # the served name
    flags: ParserFlags = field(default_factory=ParserFlags)
    clip_budget: bool = False
    limits: RequestLimits = DEFAULT_LIMITS  # what one request may make the process build
    # vLLM's render routes' budget: one past what the context leaves is cut to it, one past
    # the whole context refused in vLLM's words
    as_render_server: bool = False

    def parse(self, request: RenderRequest) -> Parsed:
        """The decoded body and its constraint, refused (400/404) before anything is
        tokenized."""
        req = decode_body(request.api, request.body, self.limits)
        check_model(req.model, self.model)
        reject_unsupported(req)
        if isinstance(req, CompletionRequest):
            completion_prompts(req)
        else:  # before its constraint reads the tools
            check_tool_choice(req)
            if keeps_special_tokens(req, self.flags):
                req.skip_special_tokens = False
        try:
            channels = parsers.is_harmony(self.flags.reasoning_parser, self.flags.tool_call_parser)
            return Parsed(req, structured.constraint(req, call_tags(self.flags), channels))
        except InvalidRequest as exc:
            exc.param = exc.param and _param(request.api, exc.param)
            raise

    def build(
        self,
        request: RenderRequest,
        parsed: Parsed,
        prompts: list[list[int]],
        vocab: Mapping[str, int],
        remote: SamplingParams | None = None,
    ) -> GenerateRequest:
        """The tokenized request for its prompts' IDs (several only for completions).
        `vocab` finds the reasoning markers; `remote` is a render server's sampling
        parameters, taken where tokenway's own output stage does not act on them."""
        req = parsed.req
        chat = isinstance(req, ChatCompletionRequest)
        ids, *more = prompts
        if not ids or not all(more):
            prompt = _param(request.api, "messages" if chat else "prompt")
            raise InvalidRequest("the prompt is empty after rendering", param=prompt)
        max_tokens = self._budget(ids, req, request.api)
        several = None
        if more:  # several prompts: each its own budget, as vLLM gives each its own
            several = [
                Prompt(token_ids=p, max_tokens=self._budget(p, req, request.api)) for p in prompts
            ]
        params = sampling_params(req, max_tokens, parsed.constraint)
        if remote is not None:
            params = keep_output_fields(remote, params)
        parse = self._parse(req, ids, vocab, params)
        context = self._context(request, req, ids, params, parse)
        opts = req.stream_options
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
            prompts=several,
            reasoning_ended=reasoning_ended(req, self.flags.reasoning_parser, ids, vocab)
            if params.structured_outputs
            else None,
        )

    def output_of(
        self, request: RenderRequest, parsed: Parsed, ids: list[int], vocab: Mapping[str, int]
    ) -> OutputContext:
        """How derender shapes the output of this request had its prompt been `ids` (none:
        not known), with nothing of a budget checked: for vLLM's derender routes, whose
        request was rendered and run elsewhere."""
        req = parsed.req
        params = sampling_params(req, self.info.context_length, parsed.constraint)
        parse = self._parse(req, ids, vocab, params)
        return self._context(request, req, ids, params, parse)

    def _parse(
        self, req: OpenAIRequest, ids: list[int], vocab: Mapping[str, int], params: SamplingParams
    ) -> ParseContext | None:
        """How derender parses a chat's output (None for a completion)."""
        if not isinstance(req, ChatCompletionRequest):
            return None
        return parse_context(req, ids, self.flags, vocab, params.structured_outputs)

    def _context(
        self,
        request: RenderRequest,
        req: OpenAIRequest,
        ids: list[int],
        params: SamplingParams,
        parse: ParseContext | None,
    ) -> OutputContext:
        opts = req.stream_options
        return OutputContext(
            api=request.api,
            response_id=f"{_ID_PREFIXES[request.api]}{self._id(request, req)}",
            model=self.model,
            created=request.created,
            prompt_tokens=len(ids),
            prompt_tail=ids[-SEED_TOKENS:],
            stream=bool(req.stream),
            stream_interval=req.stream_interval or 1,
            include_usage=bool(opts and opts.include_usage),
            continuous_usage_stats=bool(opts and opts.continuous_usage_stats),
            echo=isinstance(req, CompletionRequest) and bool(req.echo),
            return_token_ids=bool(req.return_token_ids),
            **output_options(params),
            parse=parse,
            response_fields=responses.echoed(request.body, request.previous_response_id)
            if request.api == "responses"
            else None,
        )

    def generate(self, request: RenderRequest) -> GenerateRequest:
        """A `POST /inference/v1/generate` body: token IDs in, checked as the schedule stage
        checks a direct publisher's (and its constraint compiled: run it on a big stack),
        answered in vLLM's generate shape. Its id is made as vLLM makes it; a budget past
        the context runs to the context, as on vLLM's route."""
        body = generate_api.decode(request.body)
        params = body.sampling_params
        tokens = GenerateRequest(
            request_id=request.request_id,
            token_ids=body.token_ids,
            sampling_params=params.carried(),
            model=body.model,
            stream=bool(body.stream),
            stream_options=StreamOptions(
                include_usage=body.include_usage,
                continuous_usage_stats=body.continuous_usage_stats,
            )
            if body.stream_options
            else None,
            priority=body.priority,
            cache_salt=body.cache_salt,
            kv_transfer_params=body.kv_transfer_params,
            return_token_ids=body.return_token_ids,
            reasoning_ended=body.reasoning_ended,
        )
        base = request.client_request_id or body.request_id or request.request_id
        if params.structured_outputs is not None:  # compiles, as a text request's must
            check(params.structured_outputs, "sampling_params.structured_outputs")
        return token_only.completed(
            tokens,
            self.model,
            self.info,
            clip=True,
            limits=self.limits,
            api="generate",
            response_id=generate_api.request_id(base),
            stream_interval=params.stream_interval or 1,
        )

    @staticmethod
    def _id(request: RenderRequest, req: OpenAIRequest) -> str:
        """What the response's id is made of, as vLLM makes it: the client's X-Request-Id,
        else the body's `request_id`, else the stream's own id. A Responses API response is
        stored under its id, so its id is always the stream's own (as vLLM's Responses route
        ignores X-Request-Id): an id a client chose would name whatever is stored under it,
        another tenant's response or an earlier one of its own."""
        if request.api == "responses":
            return request.request_id
        return request.client_request_id or req.request_id or request.request_id

    def _budget(
        self, ids: list[int], req: ChatCompletionRequest | CompletionRequest, api: Api
    ) -> int:
        chat = isinstance(req, ChatCompletionRequest)
        asked = "max_tokens"
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens:
            asked = "max_completion_tokens"
        requested, context = requested_max_tokens(req), self.info.context_length
        if self.as_render_server and requested is not None and requested > context:
            raise InvalidRequest(
                f"{_param(api, asked)}={requested} cannot be greater than "
                f"max_model_len={context}. Please request fewer output tokens.",
                param=_param(api, asked),
            )
        left = budget(
            len(ids),
            requested,
            context,
            self.clip_budget or self.as_render_server,
            prompt_param=_param(api, "messages" if chat else "prompt"),
            budget_param=_param(api, asked),
        )
        if req.min_tokens > left:  # vLLM's own check, on the budget its default gives too
            raise InvalidRequest(
                f"min_tokens must be less than or equal to max_tokens={left}, "
                f"got {req.min_tokens}.",
                param="min_tokens",
            )
        return left


@functools.lru_cache(maxsize=8)
def hf_tokenizer(model_dir: Path) -> tuple[PreTrainedTokenizerBase, Mapping[str, int]]:
    """The model directory's tokenizer with its chat template, and its vocabulary: read
    once per process (1.4 s for a 128k vocabulary), shared by every renderer of the model
    (encoding and templating leave it as it was)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer, tokenizer.get_vocab()


class Renderer:
    """Local rendering: the model directory's tokenizer and chat template."""

    def __init__(
        self,
        model: ModelInfo,
        served_model_name: str,
        flags: ParserFlags | None = None,
        clip_budget: bool = False,
        limits: RequestLimits = DEFAULT_LIMITS,
    ) -> None:
        self.builder = RequestBuilder(
            model, served_model_name, flags or ParserFlags(), clip_budget, limits
        )
        self.tokenizer, self.vocab = hf_tokenizer(Path(model.path))
        self.vocab_size = len(self.tokenizer)
        self.floor = TokenFloor(self.tokenizer.backend_tokenizer)
        self.harmony = model.harmony
        if self.harmony:
            harmony.check_vocabulary(self.vocab)

    def prompt_ids(self, req: OpenAIRequest, api: Api | None = None) -> list[list[int]]:
        """Token IDs per prompt: one for chat, one or several for completions (`api`: the
        client's, for the name of the parameter an error is about)."""
        if isinstance(req, ChatCompletionRequest) and self.harmony:
            try:
                return [harmony.prompt_ids(req)]
            except InvalidRequest as exc:
                exc.param = exc.param and _param(api or "chat", exc.param)
                raise
        if isinstance(req, ChatCompletionRequest):
            text = apply_template(self.tokenizer, req)
            self._fits(text, _param(api or "chat", "messages"))
            return [self.tokenizer.encode(text, add_special_tokens=False)]
        return [self._prompt(p, req.add_special_tokens) for p in completion_prompts(req)]

    def _fits(self, text: str, param: str) -> None:
        """A text certainly past the context, refused before the tokenizer takes about
        140 bytes of memory per byte of it (`token_floor`)."""
        context = self.builder.info.context_length
        if 4 * len(text) < context:  # fewer bytes than the context: fewer tokens too
            return
        least = self.floor(text)
        if least >= context:
            raise InvalidRequest(
                f"This model's maximum context length is {context} tokens, but the prompt "
                f"has at least {least} tokens. Please shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def _prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            self._fits(prompt, "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        bad = next((t for t in prompt if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary", param="prompt")
        return list(prompt)

    def render(self, request: RenderRequest) -> GenerateRequest:
        parsed = self.builder.parse(request)
        ids = self.prompt_ids(parsed.req, request.api)
        return self.builder.build(request, parsed, ids, self.vocab)
