"""One API request's worker calls: fan-out, retry, and token deltas turned into text deltas.

A request has one worker call per prompt, each sampling `n` choices. The calls are streamed
through the prefix-aware router and interleaved as tokens arrive; each choice detokenizes
incrementally and applies the stop strings, so only text that is safe to show comes out. A
prompt whose worker dies before anything of it reached the client is sent again (Serve routes
it to a live replica); once the client saw some of it, a dead worker is an error, never a
silent restart. A worker that sends nothing, not even a keepalive, for `stall_timeout_s` is
stalled (a stopped process, a hung driver): the prompt is retried elsewhere as above, or the
request ends with an error, and the worker is reported (cluster/worker_health.py) so the router
leaves it out until it answers again. Closing the stream cancels the worker calls, which aborts
the requests in the engines and frees their blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from prefixserve.cluster.errors import ApiError
from prefixserve.cluster.responses import Usage
from prefixserve.cluster.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
from prefixserve.router.request import GenerateRequest, TokenDelta, TokenLogprob
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.router.worker_watch import WATCH
from prefixserve.workers.errors import InvalidRequestError

logger = logging.getLogger("ray.serve")

MAX_WORKER_RETRIES = 2  # re-sends of a prompt whose worker died before the client saw any of it


class WorkerStalled(Exception):
    """A worker sent nothing, not even a keepalive, within the progress deadline."""


def to_api_error(exc: BaseException) -> ApiError:
    """Map what a worker call may raise to an HTTP status (Ray wraps worker exceptions)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, BackPressureError):
        return ApiError(503, "the cluster is overloaded; retry later", "server_error",
                        code="overloaded")
    if isinstance(exc, WorkerStalled):
        return ApiError(503, str(exc), "server_error", code="worker_stalled")
    if isinstance(exc, RayActorError | DeploymentUnavailableError):
        return ApiError(503, "a worker became unavailable; retry", "server_error",
                        code="worker_unavailable")
    if isinstance(exc, TaskCancelledError):  # the client went away; nobody reads this
        return ApiError(503, "the request was cancelled", "server_error", code="cancelled")
    logger.exception("internal error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error")


@dataclass
class ChoiceDelta:
    """New output of one choice: text that is safe to show, and its tokens' logprobs."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None  # one per token
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it


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
    prompts: list[list[int]]
    sampling: SamplingParams
    stops: list[str]
    cache_salt: str | None
    tenant: str | None = None  # the API key's tenant: the workers queue tenants fairly
    stall_timeout_s: float | None = None  # a worker silent this long is stalled; None: no limit
    on_stall: Callable[[str], None] | None = None  # told the replica id of a stalled worker
    keep_special: frozenset[int] = frozenset()  # special tokens the text keeps (tool markers)
    skip_special: bool = True  # False: the text writes every special token (vLLM's option)
    include_stop: bool = False  # the stop string or token ends the text (vLLM's option)
    lora: str | None = None  # the LoRA adapter's identity (name@digest); None: the base model
    model: str | None = None  # the adapter's name, as responses echo it; None: the base's
    lora_path: str | None = None  # where a worker that lacks the adapter loads it from
    choices: list[list[_Choice]] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    served_by: list[set[str]] = field(default_factory=list)  # per prompt: worker replica ids
    shown: set[int] = field(default_factory=set)  # prompts with output passed to the client

    def __post_init__(self) -> None:
        self.choices = [[] for _ in self.prompts]
        self.cached_tokens = [0] * len(self.prompts)
        self.served_by = [set() for _ in self.prompts]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.sampling.n

    def usage(self) -> Usage:
        return Usage.of(
            prompt_tokens=sum(len(p) for p in self.prompts),
            completion_tokens=sum(c.num_tokens for cs in self.choices for c in cs),
            cached_tokens=sum(self.cached_tokens),
        )

    def workers_used(self) -> list[str]:
        """The replica ids that served the request, sorted."""
        return sorted(set().union(*self.served_by))

    def _prompt_done(self, p: int) -> bool:
        return all(c.done for c in self.choices[p])

    def _stop_early(self, p: int) -> bool:
        """Stop strings ended every sample of prompt `p` while the engine still runs some."""
        return self._prompt_done(p) and not all(c.engine_done for c in self.choices[p])

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Text deltas of all choices, interleaved as the workers produce them."""
        merged = merge_streams(self._start, len(self.prompts), self._stop_early,
                               can_retry=lambda p: p not in self.shown,
                               deadline_s=self.stall_timeout_s, on_stall=self._stalled)
        try:
            async with aclosing(merged):
                async for p, delta in merged:
                    out = self._apply(p, delta)
                    if out is not None and (out.text or out.finish_reason or out.logprobs):
                        self.shown.add(p)
                        yield out
        finally:
            for p in range(len(self.prompts)):
                WATCH.forget(self._call_id(p))
        if not all(self._prompt_done(p) for p in range(len(self.prompts))):
            raise RuntimeError("a worker stream ended before its request finished")

    def _call_id(self, p: int) -> str:
        return f"{self.request_id}-{p}"

    def _stalled(self, p: int) -> None:
        replica = WATCH.replica_of(self._call_id(p))
        logger.warning("worker %s sent nothing for %g s (request %s)", replica,
                       self.stall_timeout_s, self._call_id(p))
        if replica is not None and self.on_stall is not None:
            self.on_stall(replica)

    def _start(self, p: int) -> DeploymentResponseGenerator:
        """Prompt `p` on a worker, from a clean state. Called again (a retry) only while none
        of `p`'s output has been passed on, so nothing the client saw is lost or repeated."""
        self.choices[p] = [
            _Choice(self.tokenizer.detokenizer(self.prompts[p], self.keep_special,
                                               self.skip_special),
                    StopChecker(self.stops, self.include_stop))
            for _ in range(self.sampling.n)
        ]
        self.cached_tokens[p] = 0
        self.served_by[p] = set()
        return self.workers.options(stream=True).generate.remote(
            GenerateRequest(
                request_id=self._call_id(p), prompt_token_ids=self.prompts[p],
                sampling=self.sampling, cache_salt=self.cache_salt, tenant=self.tenant,
                lora=self.lora, lora_path=self.lora_path,
            )
        )

    def _apply(self, p: int, delta: TokenDelta) -> ChoiceDelta | None:
        self.cached_tokens[p] = max(self.cached_tokens[p], delta.num_cached_tokens)
        self.served_by[p].add(delta.worker)
        choice = self.choices[p][delta.index]
        choice.engine_done = choice.engine_done or delta.finished
        if choice.done:  # already ended by a stop string
            return None
        choice.num_tokens += len(delta.token_ids)
        tokens, stop_token = delta.token_ids, None
        if delta.finish_reason == "stop" and tokens:  # the engine's: EOS or a stop token id
            stop_token = tokens[-1]
            tokens = tokens if self.include_stop else tokens[:-1]  # its text, as vLLM
        # Stop strings count only past min_tokens, as vLLM (EOS and stop ids: the engine).
        check = choice.num_tokens > self.sampling.min_tokens
        text, stopped = choice.stop.add(choice.detok.add(tokens), check)
        finish = reason = None
        if not stopped and delta.finished:
            tail, stopped = choice.stop.add(choice.detok.flush())
            text += tail if stopped else tail + choice.stop.flush()
            finish = delta.finish_reason
            if stop_token in self.sampling.stop_token_ids:  # EOS: None, as vLLM
                reason = stop_token
        if stopped:
            finish, reason = "stop", choice.stop.matched
        choice.done = finish is not None
        index = p * len(self.choices[p]) + delta.index
        return ChoiceDelta(index, text, delta.logprobs, finish, reason)


async def _next(stream: DeploymentResponseGenerator) -> TokenDelta:
    return await stream.__anext__()


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def merge_streams(
    start: Callable[[int], DeploymentResponseGenerator],
    count: int,
    stop_early: Callable[[int], bool],
    can_retry: Callable[[int], bool],
    retries: int = MAX_WORKER_RETRIES,
    deadline_s: float | None = None,
    on_stall: Callable[[int], None] = lambda i: None,
) -> AsyncIterator[tuple[int, TokenDelta]]:
    """Interleave the worker streams ``start(0..count-1)``.

    A stream whose worker dies while ``can_retry(i)`` (nothing of it reached the client yet) is
    started again, and Serve routes it to a live replica; otherwise a dead worker is an error.
    A stream that brings nothing (keepalives count, and are not passed on) for ``deadline_s``
    is cancelled and ``on_stall(i)`` called; it is then retried the same way, or
    :class:`WorkerStalled` raised.
    A stream is cancelled once `stop_early(i)` (no more output wanted), and every unfinished
    one when the consumer stops (client gone, error), so the engines abort those requests and
    free their blocks."""
    streams = [start(i) for i in range(count)]
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(_next(s)): i
                                          for i, s in enumerate(streams)}
    exhausted: set[int] = set()
    attempts = [0] * count
    loop = asyncio.get_running_loop()
    heard = [loop.time()] * count  # when each stream last brought something

    def restart(i: int, why: str) -> None:
        attempts[i] += 1
        logger.warning("%s before output; retry %d of %d", why, attempts[i], retries)
        streams[i] = start(i)
        heard[i] = loop.time()
        pending[asyncio.ensure_future(_next(streams[i]))] = i

    try:
        while pending:
            timeout = None if deadline_s is None else \
                max(0.0, min(heard[i] for i in pending.values()) + deadline_s - loop.time())
            done, _ = await asyncio.wait(pending, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                heard[i] = loop.time()
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    exhausted.add(i)
                    continue
                except RayActorError as exc:
                    if not can_retry(i) or attempts[i] >= retries:
                        raise
                    restart(i, f"worker died ({exc!r})")
                    continue
                if item.keepalive:
                    pending[asyncio.ensure_future(_next(streams[i]))] = i
                    continue
                yield i, item
                if stop_early(i):
                    streams[i].cancel()
                    exhausted.add(i)
                else:
                    pending[asyncio.ensure_future(_next(streams[i]))] = i
            if deadline_s is None:
                continue
            for fut, i in list(pending.items()):
                if loop.time() - heard[i] < deadline_s:
                    continue
                del pending[fut]
                fut.cancel()
                fut.add_done_callback(_retrieve)
                streams[i].cancel()
                on_stall(i)
                if not can_retry(i) or attempts[i] >= retries:
                    exhausted.add(i)
                    raise WorkerStalled(f"a worker sent nothing for {deadline_s:g} s; retry")
                restart(i, f"worker silent for {deadline_s:g} s")
    finally:
        for fut in pending:
            fut.cancel()
            fut.add_done_callback(_retrieve)  # a cancelled call raises: not worth a warning
        for i, s in enumerate(streams):
            if i not in exhausted:
                s.cancel()
