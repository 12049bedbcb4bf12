"""The OpenAI-compatible HTTP ingress: a FastAPI app served by a Ray Serve deployment.

Text lives here; workers are token-in / token-out. Per request the ingress validates the body
(every bad input is a 4xx in OpenAI's error envelope, never a 500), tokenizes the prompt or
renders the chat template, checks the context budget and the token ids, then streams token
deltas from the worker deployment through the prefix-aware router, turning them into text
(incremental detokenizing, stop strings) and into OpenAI responses or SSE chunks.

Streams are primed before the HTTP status is sent: an error the worker raises before its first
token (e.g. a prompt too large for its KV cache) is still a proper 400. Later errors become an
`error` event followed by `data: [DONE]`. When the client goes away, the worker calls are
cancelled, which aborts the requests in the engines and frees their blocks.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` annotation
# on the Serve-wrapped methods, or it takes `request` for a query parameter.
import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.errors import ApiError
from cluster.guard import Guard, GuardSettings, tenant_salt
from cluster.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    Usage,
    format_validation_error,
    new_id,
    now,
)
from cluster.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer, TokenizerError
from router.request import GenerateRequest
from workers.errors import InvalidRequestError

logger = logging.getLogger("ray.serve")

app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None)
app.add_middleware(Guard)
WORKER_HEADER = "x-prefixserve-worker"
CAPACITY_TIMEOUT_S = 10.0
MAX_WORKER_RETRIES = 2  # re-sends of a prompt whose worker died before the client saw any of it


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a route that parses its own body (strict errors, 413 limit):
    the schema clients and the fuzz tests (schemathesis) generate requests from."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}},
            "x-defs": defs}


def _openapi(api: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the request models' nested definitions under components."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path in schema["paths"].values():
            for op in path.values():
                components.update(op.pop("x-defs", {}))
        api.openapi_schema = schema
    return api.openapi_schema


app.openapi = partial(_openapi, app)  # type: ignore[method-assign]


def to_api_error(exc: BaseException) -> ApiError:
    """Map what a worker call may raise to an HTTP status (Ray wraps worker exceptions)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc))
    if isinstance(exc, BackPressureError):
        return ApiError(503, "the cluster is overloaded; retry later", "server_error",
                        code="overloaded")
    if isinstance(exc, RayActorError | DeploymentUnavailableError):
        return ApiError(503, "a worker became unavailable; retry", "server_error",
                        code="worker_unavailable")
    if isinstance(exc, TaskCancelledError):  # the client went away; nobody reads this
        return ApiError(503, "the request was cancelled", "server_error", code="cancelled")
    logger.exception("internal error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error")


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


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        message, param = format_validation_error(exc)
        raise ApiError(400, message, param=param) from None


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


# ---- generation: token deltas from the workers → text deltas per choice --------------------


@dataclass
class ChoiceDelta:
    """New output of one choice: text that is safe to show, and its tokens' logprobs."""

    index: int
    text: str
    logprobs: list[Any] | None  # workers.sampling.TokenLogprob, one per token
    finish_reason: str | None


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    stop: StopChecker
    num_tokens: int = 0
    done: bool = False  # no more output wanted
    engine_done: bool = False  # the engine finished it (else a stop string ended it)


@dataclass
class Generation:
    """One API request's worker calls: one per prompt, each with `n` samples."""

    workers: DeploymentHandle
    tokenizer: Tokenizer
    request_id: str
    model: str
    prompts: list[list[int]]
    sampling: dict[str, Any]
    stops: list[str]
    cache_salt: str | None
    choices: list[list[_Choice]] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    served_by: list[set[str]] = field(default_factory=list)  # per prompt: worker replica ids
    shown: set[int] = field(default_factory=set)  # prompts with output passed to the client

    def __post_init__(self) -> None:
        self.choices = [[] for _ in self.prompts]
        self.cached_tokens = [0] * len(self.prompts)
        self.served_by = [set() for _ in self.prompts]

    def usage(self) -> Usage:
        return Usage.of(
            prompt_tokens=sum(len(p) for p in self.prompts),
            completion_tokens=sum(c.num_tokens for cs in self.choices for c in cs),
            cached_tokens=sum(self.cached_tokens),
        )

    def headers(self) -> dict[str, str]:
        """Which workers served the request (benchmarks count per-worker traffic with it)."""
        workers = set().union(*self.served_by)
        return {WORKER_HEADER: ",".join(sorted(workers))} if workers else {}

    def _prompt_done(self, p: int) -> bool:
        return all(c.done for c in self.choices[p])

    def _stop_early(self, p: int) -> bool:
        """Stop strings ended every sample of prompt `p` while the engine still runs some."""
        return self._prompt_done(p) and not all(c.engine_done for c in self.choices[p])

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Text deltas of all choices, interleaved as the workers produce them."""
        merged = _merge(self._start, len(self.prompts), self._stop_early,
                        can_retry=lambda p: p not in self.shown)
        async with aclosing(merged):
            async for p, delta in merged:
                out = self._apply(p, delta)
                if out is not None and (out.text or out.finish_reason or out.logprobs):
                    self.shown.add(p)
                    yield out
        if not all(self._prompt_done(p) for p in range(len(self.prompts))):
            raise RuntimeError("a worker stream ended before its request finished")

    def _start(self, p: int) -> DeploymentResponseGenerator:
        """Prompt `p` on a worker, from a clean state. Called again (a retry) only while none
        of `p`'s output has been passed on, so nothing the client saw is lost or repeated."""
        self.choices[p] = [
            _Choice(self.tokenizer.detokenizer(self.prompts[p]), StopChecker(self.stops))
            for _ in range(self.sampling["n"])
        ]
        self.cached_tokens[p] = 0
        self.served_by[p] = set()
        return self.workers.options(stream=True).generate.remote(
            GenerateRequest(
                request_id=f"{self.request_id}-{p}", prompt_token_ids=self.prompts[p],
                sampling=self.sampling, cache_salt=self.cache_salt, model=self.model,
            )
        )

    def _apply(self, p: int, delta: Any) -> ChoiceDelta | None:
        self.cached_tokens[p] = max(self.cached_tokens[p], delta.num_cached_tokens)
        self.served_by[p].add(delta.worker)
        choice = self.choices[p][delta.index]
        choice.engine_done = choice.engine_done or delta.finished
        if choice.done:  # already ended by a stop string
            return None
        choice.num_tokens += len(delta.token_ids)
        text, stopped = choice.stop.add(choice.detok.add(delta.token_ids))
        finish = None
        if not stopped and delta.finished:
            tail, stopped = choice.stop.add(choice.detok.flush())
            text += tail if stopped else tail + choice.stop.flush()
            finish = delta.finish_reason
        if stopped:
            finish = "stop"
        choice.done = finish is not None
        index = p * len(self.choices[p]) + delta.index
        return ChoiceDelta(index, text, delta.logprobs, finish)


async def _next(stream: DeploymentResponseGenerator) -> Any:
    return await stream.__anext__()


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def _merge(
    start: Callable[[int], DeploymentResponseGenerator],
    count: int,
    stop_early: Callable[[int], bool],
    can_retry: Callable[[int], bool],
    retries: int = MAX_WORKER_RETRIES,
) -> AsyncIterator[tuple[int, Any]]:
    """Interleave the worker streams ``start(0..count-1)``.

    A stream whose worker dies while ``can_retry(i)`` (nothing of it reached the client yet) is
    started again, and Serve routes it to a live replica; otherwise a dead worker is an error.
    A stream is cancelled once `stop_early(i)` (no more output wanted), and every unfinished
    one when the consumer stops (client gone, error), so the engines abort those requests and
    free their blocks."""
    streams = [start(i) for i in range(count)]
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(_next(s)): i
                                          for i, s in enumerate(streams)}
    exhausted: set[int] = set()
    attempts = [0] * count
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    exhausted.add(i)
                    continue
                except RayActorError as exc:
                    if not can_retry(i) or attempts[i] >= retries:
                        raise
                    attempts[i] += 1
                    logger.warning("worker died before output (%r); retry %d of %d",
                                   exc, attempts[i], retries)
                    streams[i] = start(i)
                    pending[asyncio.ensure_future(_next(streams[i]))] = i
                    continue
                yield i, item
                if stop_early(i):
                    streams[i].cancel()
                    exhausted.add(i)
                else:
                    pending[asyncio.ensure_future(_next(streams[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()
            fut.add_done_callback(_retrieve)  # a cancelled call raises: not worth a warning
        for i, s in enumerate(streams):
            if i not in exhausted:
                s.cancel()


async def _sse_body(first: str, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The rest of the stream; an error mid-stream is an error event, and [DONE] always ends
    it. A client disconnect cancels this generator, and closing `chunks` cancels the workers."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        yield sse(to_api_error(exc).body)
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


def _finish(deltas: list[ChoiceDelta]) -> str | None:
    return deltas[-1].finish_reason if deltas else None


# ---- the deployment ------------------------------------------------------------------------


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    """OpenAI API over the LLMWorker deployment (plain, serialisable constructor args)."""

    def __init__(self, workers: DeploymentHandle, model: str, model_name: str,
                 max_model_len: int | None = None, guard: GuardSettings | None = None,
                 salt_secret: bytes = b"") -> None:
        from workers.checkpoints import resolve_checkpoint
        from workers.model_config import load_model_config

        Guard.configure(guard or GuardSettings())
        self.salt_secret = salt_secret
        self.kv_capacity: int | None = None  # tokens one worker's KV pool holds; asked once
        self.workers = workers
        model_path = resolve_checkpoint(model)  # on this node: paths differ between nodes
        self.tokenizer = Tokenizer(model_path)
        model = load_model_config(model_path)
        self.model_name = model_name
        self.max_model_len = min(max_model_len or model.max_model_len, model.max_model_len)
        self.vocab_size = model.vocab_size
        self.created = now()

    # -- routes -------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return ModelList(data=[self._card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self._card().model_dump()

    @app.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse_body(CompletionRequest, await request.body())
        self._check_model(req.model)
        self._check_stop_ids(req.stop_token_ids)
        prompts = [self._prompt_ids(p) for p in req.prompts()]
        max_tokens = req.max_tokens or 16  # null: OpenAI's default
        for ids in prompts:
            self._check_context(len(ids), max_tokens, "prompt")
            await self._check_capacity(len(ids), "prompt")
        sampling = req.sampling_fields() | {"max_tokens": max_tokens, "logprobs": req.logprobs}
        gen = self._generation("cmpl", prompts, sampling, req.stop_strings,
                               self._salt(request, req.cache_salt))
        if req.stream:
            return await self._stream(gen, self._completion_chunks(gen, req))
        body = (await self._completion(gen, req)).model_dump()
        return JSONResponse(body, headers=gen.headers())

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
        self._check_model(req.model)
        self._check_stop_ids(req.stop_token_ids)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in req.messages
        ]
        try:
            ids = self.tokenizer.encode_chat(messages, req.add_generation_prompt)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        if not ids:
            raise ApiError(400, "the rendered conversation is empty", param="messages")
        max_tokens = req.max_output_tokens or max(self.max_model_len - len(ids), 1)
        self._check_context(len(ids), max_tokens, "messages")
        await self._check_capacity(len(ids), "messages")
        sampling = req.sampling_fields() | {"max_tokens": max_tokens,
                                            "logprobs": req.num_logprobs}
        gen = self._generation("chatcmpl", [ids], sampling, req.stop_strings,
                               self._salt(request, req.cache_salt))
        if req.stream:
            return await self._stream(gen, self._chat_chunks(gen, req))
        body = (await self._chat(gen, req)).model_dump()
        return JSONResponse(body, headers=gen.headers())

    # -- validation ---------------------------------------------------------------------------

    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created,
                         max_model_len=self.max_model_len)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`.", param="model", code="model_not_found")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ApiError(400, "prompt encodes to no tokens", param="prompt")
            return ids
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param="prompt")
        return prompt

    def _check_stop_ids(self, ids: list[int] | None) -> None:
        bad = [t for t in ids or [] if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"stop token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param="stop_token_ids")

    def _check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {param}, "
                f"{max_tokens} for the completion). Please reduce the length of the {param} or "
                "the completion.",
                param=param, code="context_length_exceeded",
            )

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

    def _salt(self, request: Request, client_salt: str | None) -> str | None:
        """The request's cache namespace: the tenant's, when API keys are on."""
        return tenant_salt(self.salt_secret, getattr(request.state, "tenant", None),
                           client_salt)

    def _generation(self, kind: str, prompts: list[list[int]], sampling: dict[str, Any],
                    stops: list[str], cache_salt: str | None) -> Generation:
        return Generation(self.workers, self.tokenizer, new_id(kind), self.model_name, prompts,
                          sampling, stops, cache_salt)

    # -- responses ----------------------------------------------------------------------------

    async def _collect(self, gen: Generation) -> list[list[ChoiceDelta]]:
        per_choice: list[list[ChoiceDelta]] = [
            [] for _ in range(len(gen.prompts) * gen.sampling["n"])
        ]
        try:
            async with aclosing(gen.deltas()) as deltas:
                async for d in deltas:
                    per_choice[d.index].append(d)
        except Exception as exc:
            raise to_api_error(exc) from None
        return per_choice

    async def _completion(self, gen: Generation, req: CompletionRequest) -> CompletionResponse:
        choices = []
        for i, ds in enumerate(await self._collect(gen)):
            logprobs = self._completion_logprobs(ds) if req.logprobs is not None else None
            choices.append(CompletionChoice(index=i, text="".join(d.text for d in ds),
                                            logprobs=logprobs, finish_reason=_finish(ds)))
        return CompletionResponse(id=gen.request_id, created=now(), model=self.model_name,
                                  choices=choices, usage=gen.usage())

    async def _chat(self, gen: Generation, req: ChatCompletionRequest) -> ChatCompletionResponse:
        choices = []
        for i, ds in enumerate(await self._collect(gen)):
            logprobs = self._chat_logprobs(ds) if req.logprobs else None
            message = ChatResponseMessage(content="".join(d.text for d in ds))
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs,
                                      finish_reason=_finish(ds)))
        return ChatCompletionResponse(id=gen.request_id, created=now(), model=self.model_name,
                                      choices=choices, usage=gen.usage())

    def _completion_logprobs(self, deltas: Iterable[ChoiceDelta], offset: int = 0
                             ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for d in deltas:
            for lp in d.logprobs or []:
                text = self.tokenizer.token_text(lp.token_id)
                out.tokens.append(text)
                out.token_logprobs.append(lp.logprob)
                out.top_logprobs.append(
                    {self.tokenizer.token_text(t): v for t, v in lp.top})
                out.text_offset.append(offset)
                offset += len(text)
        return out

    def _chat_logprobs(self, deltas: Iterable[ChoiceDelta]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            raw = self.tokenizer.token_bytes(token_id)
            return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob,
                              bytes=list(raw))

        content = []
        for d in deltas:
            for lp in d.logprobs or []:
                main = entry(lp.token_id, lp.logprob)
                content.append(ChatTokenLogprob(
                    **main.model_dump(), top_logprobs=[entry(t, v) for t, v in lp.top]))
        return ChatLogprobs(content=content)

    async def _completion_chunks(self, gen: Generation, req: CompletionRequest
                                 ) -> AsyncIterator[str]:
        created, offsets = now(), [0] * (len(gen.prompts) * req.n)
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs([d], offsets[d.index])
                    offsets[d.index] += sum(len(t) for t in logprobs.tokens)
                if not (d.text or d.finish_reason or logprobs):
                    continue
                choice = CompletionChoice(index=d.index, text=d.text, logprobs=logprobs,
                                          finish_reason=d.finish_reason)
                yield sse(CompletionChunk(id=gen.request_id, created=created, model=self.model_name,
                                          choices=[choice]))
        if req.include_usage:
            yield sse(CompletionChunk(id=gen.request_id, created=created, model=self.model_name,
                                      choices=[], usage=gen.usage()))

    async def _chat_chunks(self, gen: Generation, req: ChatCompletionRequest
                           ) -> AsyncIterator[str]:
        created = now()

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=gen.request_id, created=created,
                                           model=self.model_name, choices=choices, usage=usage))

        first = True
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                if first:  # the role first, as OpenAI does; only after the stream is known good
                    first = False
                    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                           content=""))
                                 for i in range(req.n)])
                logprobs = self._chat_logprobs([d]) if req.logprobs else None
                if not (d.text or d.finish_reason or (logprobs and logprobs.content)):
                    continue
                yield chunk([ChatChunkChoice(index=d.index, delta=ChatDelta(content=d.text or None),
                                             logprobs=logprobs, finish_reason=d.finish_reason)])
        if req.include_usage:
            yield chunk([], gen.usage())

    async def _stream(self, gen: Generation, chunks: AsyncIterator[str]) -> Response:
        """Prime the stream (errors before the first chunk are plain HTTP errors), then SSE."""
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = ""
        except Exception as exc:
            await chunks.aclose()
            raise to_api_error(exc) from None
        return StreamingResponse(
            _sse_body(first, chunks), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **gen.headers()},
        )

