"""The OpenAI-compatible HTTP ingress: a FastAPI app served by a Ray Serve deployment.

Text lives here; workers are token-in / token-out. Per request the ingress validates the body
(every bad input is a 4xx in OpenAI's error envelope, never a 500), tokenizes the prompt or
renders the chat template, checks the context budget and the token ids, then hands the token
prompts to a `Generation` (cluster/generation.py: the worker calls through the prefix-aware
router, text deltas out) and its deltas to the `Renderer` (cluster/render.py: OpenAI bodies or
SSE chunks).

Before any worker runs, a request is also held to a cost bound (`max_request_tokens` to
generate, `max_request_logprobs` entries: 400 `request_too_costly`), and text that cannot fit
the context whatever it tokenizes to (more characters than max_model_len times the longest
token) is refused without tokenizing. The event loop stays free for other requests: long texts
are tokenized and chat templates rendered on a small thread pool (the tokenizer releases the
GIL), as are the bodies of non-streamed responses with logprobs; short ones stay inline, where
a thread hop would cost more than the work.

The ingress reads the checkpoint's tokenizer and config.json only; it never imports torch.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` annotation
# on the Serve-wrapped methods, or it takes `request` for a query parameter.
import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from importlib import metadata
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixserve.cluster.api_schema import body_doc, openapi_schema, parse_body
from prefixserve.cluster.chat_protocol import template_tools
from prefixserve.cluster.errors import ApiError
from prefixserve.cluster.generation import Generation, to_api_error
from prefixserve.cluster.guard import Guard, GuardSettings, tenant_salt
from prefixserve.cluster.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from prefixserve.cluster.render import Renderer, collect, stream_response, worker_headers
from prefixserve.cluster.request_limits import RequestLimits
from prefixserve.cluster.responses import ModelList, new_id, now
from prefixserve.cluster.served_models import Adapter, ServedModels
from prefixserve.cluster.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRARequest,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRARequest,
    VersionResponse,
)
from prefixserve.cluster.tokenizer import TemplateKwargsError, Tokenizer, TokenizerError
from prefixserve.cluster.tool_parsers import TOOL_PARSERS
from prefixserve.cluster.worker_health import WorkerHealth
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.model_sources import model_source

logger = logging.getLogger("ray.serve")

app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None)
app.add_middleware(Guard)
CAPACITY_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 2.0  # a worker that takes longer to answer /ready's stats call is not ready
INLINE_CHARS = 4096  # text up to this long is tokenized inline (~1 ms); longer: on the pool
MESSAGE_CHARS = 64  # what a chat message weighs against INLINE_CHARS besides its text
INLINE_TOKENS = 1024  # token ids up to this many are decoded inline; more: on the pool
VERSION = metadata.version("prefixserve")
CPU_THREADS = 4  # the pool for long tokenizing and rendering
T = TypeVar("T")


app.openapi = partial(openapi_schema, app)  # type: ignore[method-assign]


def _truncated(ids: list[int], req: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens, as vLLM keeps them; else all."""
    k = req.truncate_prompt_tokens
    return ids if k is None else ids[-k:]


@app.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
    return ApiError(400, message).response()


@app.exception_handler(Exception)
async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    return to_api_error(exc).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, str(exc.detail), type_, code=exc.status_code).response()


# ---- the deployment ------------------------------------------------------------------------


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    """OpenAI API over the LLMWorker deployment (plain, serialisable constructor args)."""

    def __init__(self, workers: DeploymentHandle, model: str, model_name: str,
                 max_model_len: int | None, guard: GuardSettings,
                 salt_secret: bytes = b"", tokenizer: str | None = None,
                 chat_template: str | None = None,
                 worker_stall_timeout_s: float | None = None,
                 control_tokens_in_messages: bool = False,
                 tool_call_parser: str | None = None,
                 lora_adapters: list[Adapter] | None = None,
                 allow_runtime_lora_updating: bool = False) -> None:
        Guard.configure(guard)
        self.cpu = ThreadPoolExecutor(CPU_THREADS, thread_name_prefix="ingress-cpu")
        self.salt_secret = salt_secret
        self.kv_capacity: int | None = None  # tokens one worker's KV pool holds; asked once
        self.workers = workers
        self.stall_timeout_s = worker_stall_timeout_s
        self.message_controls = control_tokens_in_messages
        self.worker_health = WorkerHealth(workers, (worker_stall_timeout_s or 0.0) / 4)
        source = model_source(model)
        path = source.tokenizer_path(model)  # resolved on this node: paths differ between nodes
        model_len, vocab_size = source.limits(model, path)
        self.tokenizer = Tokenizer(tokenizer or path, chat_template)
        self.model_name = model_name
        self.runtime_lora = allow_runtime_lora_updating
        self.render = Renderer(self.tokenizer, model_name, tool_call_parser)
        # tool_choice `auto` reads the parser's markers, control tokens in some models
        fmt = TOOL_PARSERS.get(tool_call_parser or "")
        self.tool_markers = self.tokenizer.special_ids(fmt.markers + fmt.between) if fmt \
            else frozenset()
        self.max_model_len = min(max_model_len or model_len, model_len)
        self.bounds = RequestLimits(self.max_model_len, vocab_size,
                                    self.tokenizer.max_chars_per_token, guard.max_request_tokens,
                                    guard.max_request_logprobs)
        self.served = ServedModels(model_name, self.max_model_len, now(),
                                   {a.name: a for a in lora_adapters or ()})

    # -- routes -------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "not every worker (with min_workers: "
                                                      "fewer than that many) can serve"}})
    async def ready(self, min_workers: int | None = Query(None, ge=1)) -> JSONResponse:
        """Readiness, where /health is liveness: 200 once every worker Serve routes to answers
        and none is stalled (with `min_workers`: once that many do), else 503; the body gives
        each worker's state."""
        states = await self.worker_health.readiness(READY_TIMEOUT_S)
        serving = sum(s == "ready" for s in states.values())
        ok = serving >= (min_workers or max(len(states), 1))
        return JSONResponse({"status": "ready" if ok else "not_ready", "workers": states},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """The base model, then each LoRA adapter with the base as its `parent`."""
        return ModelList(data=[self.served.card(n) for n in self.served.names()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        self.served.resolve(model_id)
        return self.served.card(model_id).model_dump()

    @app.post("/v1/load_lora_adapter", openapi_extra=body_doc(LoadLoRARequest))
    async def load_lora_adapter(self, request: Request) -> PlainTextResponse:
        """vLLM's: serve another adapter. One worker loads and checks it now (a bad one is a
        400 with the reason); the others load it with its first request there."""
        req = parse_body(LoadLoRARequest, await self._runtime_lora(request))
        self.served.check_free(req.lora_name)
        try:
            identity = await self.workers.load_lora.remote(req.lora_name, req.lora_path)
        except Exception as exc:
            raise to_api_error(exc) from None
        self.served.add(Adapter(req.lora_name, identity, req.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_doc(UnloadLoRARequest))
    async def unload_lora_adapter(self, request: Request) -> PlainTextResponse:
        """vLLM's: stop serving an adapter (requests under way finish under it)."""
        req = parse_body(UnloadLoRARequest, await self._runtime_lora(request))
        self.served.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")

    async def _runtime_lora(self, request: Request) -> bytes:
        if not self.runtime_lora:
            raise ApiError(404, "loading LoRA adapters at run time is off "
                           "(allow_runtime_lora_updating)", code="not_found")
        return await request.body()

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        return VersionResponse(version=VERSION).model_dump()

    @app.post("/tokenize", openapi_extra=body_doc(TokenizeRequest))
    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt's or a rendered chat's token ids (no generation)."""
        req = parse_body(TokenizeRequest, await request.body())
        self.served.resolve(req.model)
        if req.messages is not None:
            param = "messages"
            ids = await self._chat_ids(req.messages, req.add_generation_prompt,
                                       req.chat_template_kwargs, req.special_tokens,
                                       template_tools(req.tools))
        else:
            param, prompt = "prompt", req.prompt or ""
            self.bounds.chars(len(prompt), param)
            ids = await self._run(len(prompt) > INLINE_CHARS, self.tokenizer.encode, prompt,
                                  req.special_tokens)
        self.bounds.length(len(ids), param)
        strs = [self.tokenizer.token_piece(i) for i in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    @app.post("/detokenize", openapi_extra=body_doc(DetokenizeRequest))
    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: token ids back to text, special tokens included."""
        req = parse_body(DetokenizeRequest, await request.body())
        self.served.resolve(req.model)
        self.bounds.length(len(req.tokens), "tokens")
        self.bounds.ids(req.tokens, "tokens")
        text = await self._run(len(req.tokens) > INLINE_TOKENS, self.tokenizer.decode,
                               req.tokens, False)
        return DetokenizeResponse(prompt=text).model_dump()

    @app.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        req = parse_body(CompletionRequest, await request.body())
        adapter = self.served.resolve(req.model)
        self._check_ids(req)
        max_tokens = req.max_tokens or 16  # null: OpenAI's default
        inputs = req.prompts()
        self.bounds.cost(len(inputs), req.n, max_tokens, req.logprobs, "logprobs")
        for prompt in inputs:  # cheap checks of every prompt before tokenizing any
            if isinstance(prompt, str):
                self.bounds.chars(len(prompt), "prompt")
            else:
                self.bounds.context(len(_truncated(prompt, req)), max_tokens, "prompt")
        prompts = [_truncated(await self._prompt_ids(p, req.add_special_tokens), req)
                   for p in inputs]
        for ids in prompts:
            self.bounds.context(len(ids), max_tokens, "prompt")
            await self._check_capacity(len(ids), "prompt")
        sampling = req.sampling_params(max_tokens, req.logprobs)
        gen = self._generation("cmpl", prompts, sampling, req, request, adapter)
        if req.stream:
            return await stream_response(gen, self.render.completion_chunks(gen, req))
        per_choice = await collect(gen)
        return await self._run(req.logprobs is not None, self._json_response,
                               self.render.completion, gen, req, per_choice)

    @app.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await request.body())
        adapter = self.served.resolve(req.model)
        self._check_ids(req)
        if req.tool_mode == "auto" and self.render.tool_parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs the server '
                           'started with --enable-auto-tool-choice and --tool-call-parser',
                           param="tool_choice")
        ids = _truncated(await self._chat_ids(req.messages, req.add_generation_prompt,
                                              req.chat_template_kwargs, req.add_special_tokens,
                                              template_tools(req.tools)), req)
        if not ids:
            raise ApiError(400, "the rendered conversation is empty", param="messages")
        max_tokens = req.max_output_tokens or max(self.max_model_len - len(ids), 1)
        self.bounds.context(len(ids), max_tokens, "messages")
        self.bounds.cost(1, req.n, max_tokens, req.num_logprobs, "top_logprobs",
                         rest_of_context=req.max_output_tokens is None)
        await self._check_capacity(len(ids), "messages")
        sampling = req.sampling_params(max_tokens, req.num_logprobs)
        gen = self._generation("chatcmpl", [ids], sampling, req, request, adapter)
        if req.tool_mode == "auto":
            gen.keep_special = self.tool_markers
        if req.stream:
            return await stream_response(gen, self.render.chat_chunks(gen, req))
        per_choice = await collect(gen)
        return await self._run(req.logprobs, self._json_response, self.render.chat, gen, req,
                               per_choice)

    # -- validation ---------------------------------------------------------------------------

    def _check_ids(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """The request's token ids (stop, logit_bias, allowed) within the vocabulary."""
        self.bounds.stop_ids(req.stop_token_ids)
        self.bounds.logit_bias(req.logit_bias_ids)
        self.bounds.ids(req.allowed_token_ids or [], "allowed_token_ids")

    async def _prompt_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            ids = await self._run(len(prompt) > INLINE_CHARS, self.tokenizer.encode, prompt,
                                  add_special_tokens)
            if not ids:
                raise ApiError(400, "prompt encodes to no tokens", param="prompt")
            return ids
        self.bounds.ids(prompt, "prompt")
        return prompt

    async def _chat_ids(self, chat: list[ChatMessage], add_generation_prompt: bool,
                        template_kwargs: dict[str, Any] | None,
                        add_special_tokens: bool = False,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation's token ids: length-checked, then rendered and tokenized (on the
        pool when long)."""
        messages = [m.template_message() for m in chat]
        chars = sum(len(m.text()) + sum(len(c.function.arguments) for c in m.tool_calls or ())
                    for m in chat)
        self.bounds.chars(chars, "messages")
        heavy = chars + MESSAGE_CHARS * (len(messages) + len(tools or ())) > INLINE_CHARS
        return await self._run(heavy, self._encode_chat, messages, add_generation_prompt,
                               template_kwargs, add_special_tokens, tools)

    def _encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     template_kwargs: dict[str, Any] | None, add_special_tokens: bool,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's token ids, control strings in message text kept as text (unless
        the operator allows them as tokens); the rendered text is held to the same length
        bound as a prompt before it is tokenized (the template adds text per message)."""
        try:
            pieces = self.tokenizer.render_chat_pieces(
                messages, add_generation_prompt, template_kwargs, not self.message_controls,
                tools)
        except TemplateKwargsError as exc:
            raise ApiError(400, str(exc), param="chat_template_kwargs") from None
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        self.bounds.chars(sum(len(text) for text, _ in pieces), "messages")
        # The template writes BOS itself when the model wants it (as transformers does).
        return self.tokenizer.encode_pieces(pieces, add_special_tokens)

    async def _run(self, heavy: bool, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: on the thread pool when heavy, so the event loop keeps serving; else
        inline."""
        if not heavy:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.cpu, partial(fn, *args))

    @staticmethod
    def _json_response(render: Callable[..., BaseModel], gen: Generation, *args: Any
                       ) -> JSONResponse:
        return JSONResponse(render(gen, *args).model_dump(), headers=worker_headers(gen))

    async def _check_capacity(self, prompt_len: int, param: str) -> None:
        """Refuse at once a prompt no worker's KV pool can ever hold (the engine would too,
        after a round trip). The capacity comes from one worker's stats, asked once."""
        if self.kv_capacity is None:
            try:
                stats = await asyncio.wait_for(self.workers.stats.remote(), CAPACITY_TIMEOUT_S)
            except Exception:  # no worker answers yet: the engine still checks
                logger.warning("could not read the workers' KV capacity", exc_info=True)
                return
            self.kv_capacity = stats["num_total_blocks"] * stats["block_size"]
        if prompt_len + 1 > self.kv_capacity:  # the engine needs a slot for the first token
            raise ApiError(400, f"The {param} has {prompt_len} tokens; a worker's KV cache holds "
                           f"{self.kv_capacity} tokens including the first generated one.",
                           param=param, code="kv_capacity_exceeded")

    def _generation(self, kind: str, prompts: list[list[int]], sampling: SamplingParams,
                    req: CompletionRequest | ChatCompletionRequest, request: Request,
                    adapter: Adapter | None) -> Generation:
        """The request's worker calls, in the tenant's cache namespace (when API keys are on),
        under its name in the workers' fair-share queue and under its LoRA adapter, if any."""
        tenant = getattr(request.state, "tenant", None)
        gen = Generation(self.workers, self.tokenizer, new_id(kind), prompts, sampling,
                         req.stop_strings, tenant_salt(self.salt_secret, tenant, req.cache_salt),
                         tenant, self.stall_timeout_s, self.worker_health.stalled,
                         skip_special=req.skip_special_tokens,
                         include_stop=req.include_stop_str_in_output)
        if adapter is not None:
            gen.lora, gen.model, gen.lora_path = adapter.identity, adapter.name, adapter.path
        return gen
