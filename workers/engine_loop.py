"""The engine's one thread, and how its outputs reach the replica's async `generate` streams.

The engine is not thread-safe, so one loop thread (:class:`EngineLoop`) owns it: it takes add /
abort / call commands from a queue, steps the engine while work is pending, and hands each
step's outputs to the waiting request's :class:`OutputStream` with
``loop.call_soon_threadsafe``. An error in one request (bad input) fails that request only; an
exception inside a step fails the requests that step ran and the loop goes on. On the consuming
side, :func:`drain_steps` and :func:`to_deltas` turn a backlog of steps into one delta.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prefixserve.router.request import TokenDelta
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineStats, RequestOutput
from prefixserve.workers.errors import StepFailedError

log = logging.getLogger("ray.serve")


@dataclass
class OutputStream:
    """Where the loop thread sends one request's outputs (a list per step, or an exception)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    remaining: int  # samples not finished yet
    # perf_counter when the engine step that first scheduled it began (its queue time ends)
    scheduled_at: float | None = None

    def send(self, item: list[RequestOutput] | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def drain_steps(
    first: list[RequestOutput] | BaseException, pending: asyncio.Queue, backlog: bool = True
) -> tuple[list[list[RequestOutput]], BaseException | None]:
    """``first`` and every step already queued behind it, up to an error (returned apart);
    with ``backlog`` False, ``first`` alone (a first token is sent before the steps after it)."""
    steps: list[list[RequestOutput]] = []
    item = first
    while True:
        if isinstance(item, BaseException):
            return steps, item
        steps.append(item)
        if not backlog or pending.empty():
            return steps, None
        item = pending.get_nowait()


NOTHING = object()  # what next_within gives when nothing came in time


async def next_within(queue: asyncio.Queue, timeout_s: float) -> Any:
    """The queue's next item, or NOTHING after `timeout_s`. Not `asyncio.wait_for`: before
    Python 3.12 it may swallow the caller's cancel when the item arrives at the same moment,
    and a cancelled stream must end (that aborts the request)."""
    if not queue.empty():
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    try:
        done, _ = await asyncio.wait({get}, timeout=timeout_s)
    finally:
        if not get.done():
            get.cancel()
    return get.result() if done else NOTHING


def to_deltas(steps: list[list[RequestOutput]], worker: str) -> list[TokenDelta]:
    """The engine's outputs of one or more steps as the wire's deltas, one per sample, tokens in
    order: the one place an engine output is converted.

    When the consumer falls behind (a loaded host), its queued steps go out as one delta: the
    same tokens in fewer stream messages, as vLLM's output collector does, so per-message
    overhead in Serve, the ingress and the client does not grow with the backlog.
    """
    merged: dict[int, TokenDelta] = {}
    for step in steps:
        for out in step:
            prev = merged.get(out.index)
            tokens, logprobs = list(out.new_token_ids), out.new_logprobs
            if prev is not None:
                tokens = [*prev.token_ids, *tokens]
                if prev.logprobs is not None or logprobs is not None:
                    logprobs = [*(prev.logprobs or []), *(logprobs or [])]
            merged[out.index] = TokenDelta(
                index=out.index, token_ids=tokens, logprobs=logprobs, finished=out.finished,
                finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens, worker=worker)
    return list(merged.values())


@dataclass(frozen=True)
class Add:
    """Queue a request; its outputs go to ``stream`` (or the engine's refusal does)."""

    request_id: str
    prompt: Iterable[int]
    params: SamplingParams
    cache_salt: str | None
    tenant: str | None
    stream: OutputStream
    grammar: Any = None  # the compiled structured-output constraint
    lora: str | None = None  # the LoRA adapter's identity; None: the base model
    lora_path: str | None = None  # where to load it from if the engine lacks it


@dataclass(frozen=True)
class Abort:
    """Abort a request; ``notify``: its stream still gets the final "abort" outputs."""

    request_id: str
    notify: bool


@dataclass(frozen=True)
class Call:
    """Run ``fn(engine)`` on the loop thread; its result or exception goes to ``future``."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Stop:
    """Wake the loop so that it sees it is stopping."""


Command = Add | Abort | Call | Stop


class EngineLoop(threading.Thread):
    """The one thread that touches the engine."""

    # Routers read a worker's load every second or two; a snapshot a tenth of a second old is
    # fresh enough, and taking it (the queued backlog walks the waiting prompts' block hashes)
    # stays off most steps.
    def __init__(self, engine: LLMEngine, stats_interval_s: float = 0.1) -> None:
        super().__init__(name="prefixserve-engine", daemon=True)
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._stopping = threading.Event()
        self._stats_interval_s = stats_interval_s
        self._stats_at = 0.0
        # Latest (stats, wall-clock time taken), replaced whole so other threads read it safely.
        self.snapshot: tuple[EngineStats, float] = (engine.stats(), time.time())
        self.error: BaseException | None = None  # set if the loop itself died
        # When the current round (commands, then a step) began; None while waiting idle.
        self._busy_since: float | None = None

    # Called from other threads -------------------------------------------------------

    def add(self, request_id: str, prompt: Iterable[int], params: SamplingParams,
            cache_salt: str | None, stream: OutputStream, tenant: str | None = None,
            grammar: Any = None, lora: str | None = None, lora_path: str | None = None
            ) -> None:
        self._commands.put(Add(request_id, prompt, params, cache_salt, tenant, stream,
                               grammar, lora, lora_path))

    def abort(self, request_id: str, notify: bool = False) -> None:
        """Abort a request and free its blocks. ``notify``: its stream still gets the final
        "abort" outputs (a drain ends streams cleanly); else the caller is gone, and so is it."""
        self._commands.put(Abort(request_id, notify))

    def stalled_s(self) -> float:
        """Seconds the current round of work has run (0 while idle): a step that never returns
        (a hung kernel, a deadlock) shows here while every queued request waits behind it."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread; await with ``asyncio.wrap_future``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(Call(fn, future))
        return future

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._commands.put(Stop())
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)
        if not self.is_alive() and self.engine.tiers is not None:
            self.engine.tiers.close()  # the disk tier's queued writes land for the next worker

    # The loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._busy_since = time.monotonic()
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.engine.has_unfinished():
                    self._step()
                self._refresh_stats(force=not self.engine.has_unfinished())
        except BaseException as exc:  # a bug in the loop itself: fail loudly, answer everyone
            self.error = exc
            log.exception("engine loop died")
            raise
        finally:
            self._fail_everyone(RuntimeError(f"engine loop stopped: {self.error!r}"))

    def _fail_everyone(self, exc: Exception) -> None:
        """Nobody will serve what is waiting: fail it instead of leaving callers hanging."""
        for stream in self._streams.values():
            stream.send(exc)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                command.stream.send(exc)
            elif isinstance(command, Call) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(exc)

    def _drain(self, block: bool) -> None:
        try:
            if block:
                self._busy_since = None
                command = self._commands.get(timeout=0.5)
                self._busy_since = time.monotonic()
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: Command) -> None:
        if isinstance(command, Add):
            try:
                lora = None if command.lora is None else self.engine.lora_for(
                    command.lora, command.lora_path)
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        command.cache_salt, command.tenant, command.grammar,
                                        lora)
            except Exception as exc:  # InvalidRequestError, or anything the engine rejects
                command.stream.send(exc)
                return
            self._streams[command.request_id] = command.stream
        elif isinstance(command, Abort):
            if command.request_id in self._streams:
                if not command.notify:
                    del self._streams[command.request_id]
                self.engine.abort(command.request_id)
        elif isinstance(command, Call) and command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as exc:
                command.future.set_exception(exc)

    def _step(self) -> None:
        began = time.perf_counter()
        try:
            outputs = self.engine.step()
        except StepFailedError as exc:
            # The engine dropped the step's requests and published the rollback of the blocks
            # it hashed; fail exactly those streams and keep serving the rest.
            log.exception("engine step failed; failing %d requests", len(exc.request_ids))
            for request_id in exc.request_ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.send(RuntimeError(f"engine step failed: {exc.__cause__!r}"))
            return
        per_request: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            per_request.setdefault(out.request_id, []).append(out)
        self._note_scheduled(began, per_request)
        for request_id, outs in per_request.items():
            stream = self._streams.get(request_id)
            if stream is None:  # aborted: its caller is gone
                continue
            stream.remaining -= sum(1 for o in outs if o.finished)
            if stream.remaining <= 0:
                del self._streams[request_id]
            stream.send(outs)

    def _note_scheduled(self, began: float, outputs: dict[str, list[RequestOutput]]) -> None:
        """Stamp the streams whose request this step scheduled for the first time (vLLM's
        queue time ends there): it is running now, or it already has outputs."""
        waiting = [(rid, s) for rid, s in self._streams.items() if s.scheduled_at is None]
        if not waiting:
            return
        running = {seq.request_id for seq in self.engine.scheduler.running}
        for request_id, stream in waiting:
            if request_id in running or request_id in outputs:
                stream.scheduled_at = began

    def _refresh_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= self._stats_interval_s:
            self.snapshot = (self.engine.stats(), time.time())
            self._stats_at = now
