"""OpenAI responses built from a generation's text deltas: whole bodies, or SSE chunks.

A non-streaming request collects every delta before it answers. A streaming one is primed
before the HTTP status is sent: an error the worker raises before its first token (e.g. a
prompt too large for its KV cache) is still a proper HTTP error. Later errors become an `error`
event followed by `data: [DONE]`. The role chunk of a chat stream is only sent once the stream
is known good, as OpenAI sends it first.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from prefixserve.cluster.chat_protocol import NamedToolChoice
from prefixserve.cluster.generation import ChoiceDelta, Generation, to_api_error
from prefixserve.cluster.protocol import ChatCompletionRequest, CompletionRequest
from prefixserve.cluster.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallOut,
    FunctionDelta,
    ToolCallChunk,
    ToolCallOut,
    TopLogprob,
    Usage,
    now,
)
from prefixserve.cluster.tokenizer import Tokenizer
from prefixserve.cluster.tool_parsers import (
    REQUIRED_FORMAT,
    TOOL_PARSERS,
    NamedCallReader,
    Reader,
    ToolCallReader,
    read_all,
)

WORKER_HEADER = "x-prefixserve-worker"


def worker_headers(gen: Generation) -> dict[str, str]:
    """Which workers served the request (benchmarks count per-worker traffic with it)."""
    workers = gen.workers_used()
    return {WORKER_HEADER: ",".join(workers)} if workers else {}


# Characters that some line readers (Python's str.splitlines, httpx's aiter_lines) take for line
# breaks, although SSE ends a line only at CR or LF. JSON leaves them raw inside strings; escaped,
# they read back the same and an event's data stays on one line for every client.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json().translate(_LINE_BREAKS)}\n\n"


async def sse_body(first: str, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
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


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body however the response ends. Starlette leaves a stream it stopped
    reading (its write was cancelled: an idle client) to the garbage collector; closing it
    here cancels the worker calls at once."""

    body_iterator: AsyncGenerator[str, None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def stream_response(gen: Generation, chunks: AsyncIterator[str]) -> StreamingResponse:
    """Prime the stream (errors before the first chunk are plain HTTP errors), then SSE."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = ""
    except Exception as exc:
        await chunks.aclose()
        raise to_api_error(exc) from None
    return ClosingStreamingResponse(
        sse_body(first, chunks), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **worker_headers(gen)},
    )


async def collect(gen: Generation) -> list[list[ChoiceDelta]]:
    """Every delta of the generation, per choice; a failure is an ApiError."""
    per_choice: list[list[ChoiceDelta]] = [[] for _ in range(gen.num_choices)]
    try:
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                per_choice[d.index].append(d)
    except Exception as exc:
        raise to_api_error(exc) from None
    return per_choice


def _finish(deltas: list[ChoiceDelta]) -> str | None:
    return deltas[-1].finish_reason if deltas else None


def _stop_reason(deltas: list[ChoiceDelta]) -> int | str | None:
    return deltas[-1].stop_reason if deltas else None


def _running_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """vLLM's `continuous_usage_stats`: the usage so far in every chunk (with include_usage)."""
    return req.include_usage and bool(req.stream_options and
                                      req.stream_options.continuous_usage_stats)


def _tool_finish(finish: str | None, called: bool) -> str | None:
    """An answer that called tools and ended by itself finishes with `tool_calls`."""
    return "tool_calls" if called and finish == "stop" else finish


def _chat_deltas(d: ChoiceDelta, reader: Reader | None) -> tuple[list[ChatDelta], str | None]:
    """One choice's new output as stream deltas (content, then each call's id and name or
    argument text), and its finish reason."""
    if reader is None:
        return ([ChatDelta(content=d.text)] if d.text else []), d.finish_reason
    out = reader.feed(d.text)
    if d.finish_reason is not None:
        tail = reader.finish()
        out.content += tail.content
        out.calls += tail.calls
    parts = [ChatDelta(content=out.content)] if out.content else []
    parts += [ChatDelta(tool_calls=[ToolCallChunk(
        index=c.index, id=c.id, type="function" if c.id else None,
        function=FunctionDelta(name=c.name, arguments=c.arguments))]) for c in out.calls]
    return parts, _tool_finish(d.finish_reason, reader.called)


@dataclass(frozen=True)
class Renderer:
    """Renders one served model's responses; logprobs need its tokenizer's token texts, and
    tool calls are read out of the text (cluster/tool_parsers.py)."""

    tokenizer: Tokenizer
    model_name: str
    tool_parser: str | None = None  # the server's parser for tool_choice `auto`

    def completion(self, gen: Generation, req: CompletionRequest,
                   per_choice: list[list[ChoiceDelta]]) -> CompletionResponse:
        """The body of a finished request (`collect`ed); pure CPU, may run off the loop."""
        choices = []
        for i, ds in enumerate(per_choice):
            logprobs = self.completion_logprobs(ds) if req.logprobs is not None else None
            choices.append(CompletionChoice(index=i, text="".join(d.text for d in ds),
                                            logprobs=logprobs, finish_reason=_finish(ds),
                                            stop_reason=_stop_reason(ds)))
        return CompletionResponse(id=gen.request_id, created=now(), model=self._model(gen),
                                  choices=choices, usage=gen.usage())

    def _model(self, gen: Generation) -> str:
        """The model a response names: the LoRA adapter asked for, else the served model."""
        return gen.model or self.model_name

    def tool_reader(self, req: ChatCompletionRequest) -> Reader | None:
        """What reads tool calls out of one choice's text: the server's parser for `auto`, the
        JSON array of calls for `required`, the arguments for a named function; None without
        tools (or with `none`)."""
        max_calls = None if req.parallel_tool_calls else 1
        mode = req.tool_mode
        if mode == "auto" and self.tool_parser is not None:
            return ToolCallReader(TOOL_PARSERS[self.tool_parser], max_calls)
        if mode == "required":
            return ToolCallReader(REQUIRED_FORMAT, max_calls)
        if mode == "named" and isinstance(req.tool_choice, NamedToolChoice):
            return NamedCallReader(req.tool_choice.function.name)
        return None

    def chat(self, gen: Generation, req: ChatCompletionRequest,
             per_choice: list[list[ChoiceDelta]]) -> ChatCompletionResponse:
        """The body of a finished request (`collect`ed); pure CPU, may run off the loop."""
        choices = []
        for i, ds in enumerate(per_choice):
            logprobs = self.chat_logprobs(ds) if req.logprobs else None
            content, calls = "".join(d.text for d in ds), []
            if (reader := self.tool_reader(req)) is not None:
                content, calls = read_all(reader, content)
            message = ChatResponseMessage(
                content=content if content or not calls else None,
                tool_calls=[ToolCallOut(id=c.id or "", function=FunctionCallOut(
                    name=c.name or "", arguments=c.arguments)) for c in calls])
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs,
                                      finish_reason=_tool_finish(_finish(ds), bool(calls)),
                                      stop_reason=_stop_reason(ds)))
        return ChatCompletionResponse(id=gen.request_id, created=now(), model=self._model(gen),
                                      choices=choices, usage=gen.usage())

    def completion_logprobs(self, deltas: Iterable[ChoiceDelta], offset: int = 0
                            ) -> CompletionLogprobs:
        """Legacy completions logprobs: token texts, with their offsets into the choice's text."""
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

    def chat_logprobs(self, deltas: Iterable[ChoiceDelta]) -> ChatLogprobs:
        """Chat logprobs carry each token's raw bytes: a token may be part of a character."""
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

    async def completion_chunks(self, gen: Generation, req: CompletionRequest
                                ) -> AsyncIterator[str]:
        created, offsets = now(), [0] * gen.num_choices
        running = _running_usage(req)
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self.completion_logprobs([d], offsets[d.index])
                    offsets[d.index] += sum(len(t) for t in logprobs.tokens)
                if not (d.text or d.finish_reason or logprobs):
                    continue
                choice = CompletionChoice(index=d.index, text=d.text, logprobs=logprobs,
                                          finish_reason=d.finish_reason,
                                          stop_reason=d.stop_reason)
                yield sse(CompletionChunk(id=gen.request_id, created=created,
                                          model=self._model(gen), choices=[choice],
                                          usage=gen.usage() if running else None))
        if req.include_usage:
            yield sse(CompletionChunk(id=gen.request_id, created=created, model=self._model(gen),
                                      choices=[], usage=gen.usage()))

    async def chat_chunks(self, gen: Generation, req: ChatCompletionRequest
                          ) -> AsyncIterator[str]:
        created, running = now(), _running_usage(req)

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            usage = usage or (gen.usage() if running else None)
            return sse(ChatCompletionChunk(id=gen.request_id, created=created,
                                           model=self._model(gen), choices=choices, usage=usage))

        first = True
        readers = [self.tool_reader(req) for _ in range(req.n)]
        async with aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                if first:  # the role first, as OpenAI does; only after the stream is known good
                    first = False
                    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                           content=""))
                                 for i in range(req.n)])
                logprobs = self.chat_logprobs([d]) if req.logprobs else None
                parts, finish = _chat_deltas(d, readers[d.index])
                if not parts and (finish or (logprobs and logprobs.content)):
                    parts = [ChatDelta()]
                for k, part in enumerate(parts):  # logprobs with the first, finish the last
                    last = k == len(parts) - 1
                    yield chunk([ChatChunkChoice(
                        index=d.index, delta=part, logprobs=None if k else logprobs,
                        finish_reason=finish if last else None,
                        stop_reason=d.stop_reason if last else None)])
        if req.include_usage:
            yield chunk([], gen.usage())
