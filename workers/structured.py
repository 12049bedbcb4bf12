"""Structured outputs: a request's constraint compiled to a grammar, and each constrained
sample's matcher, whose token bitmask the engine applies to the logits before sampling.

Grammars are xgrammar's (as vLLM's and SGLang's): a JSON schema, a regular expression, a choice
among strings, an EBNF grammar or a structural tag becomes a `CompiledGrammar` against this
model's vocabulary. The vocabulary's tables are built on the first constrained request, so an
engine that never sees one pays nothing. Compiling runs off the engine loop, on two threads per
process, each handing its compile to a child process (workers/compile_process.py) that is
killed when the compile runs past its time limit: a constraint built to compile for a minute
gets its 400 and costs no more than that, and another compile can run beside it. Compiled
grammars are cached in this process, bounded in bytes.

Per sample, a `GrammarMatcher` follows the tokens sampled so far. At a step with constrained
samples, `mask_logits` sets every token their grammars refuse to -inf (stop tokens are allowed
only where the grammar may end), then each sampled token is accepted. A step without one does
nothing extra. Forks get fresh matchers (they fork before their first token); a preempted
sample keeps its matcher, and its recomputed prompt is not replayed through it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from prefixserve.router.sampling_params import SamplingParams, StructuredOutput
from prefixserve.workers.compile_process import CompileError, CompileProcess, CompileTimeout
from prefixserve.workers.errors import InvalidRequestError

COMPILE_TIMEOUT_S = 10.0  # a constraint that takes longer to compile is refused (400)
# How long a request waits in all for its grammar: a free compile thread (each compile ahead
# of it ends within COMPILE_TIMEOUT_S), a compile child's start (~3 s, more on a loaded
# machine), then its own compile.
WAIT_TIMEOUT_S = 60.0
CACHE_BYTES = 256 * 2**20  # compiled grammars kept, at most (counted as serialized)
# Two threads compile, for every engine in the process, each waiting on a child process: a
# runaway compile holds one of them (and one child's core, at low priority) until its limit.
COMPILE_THREADS = 2
_COMPILE_POOL = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary (thread-safe, cached)."""

    def __init__(self, tokenizer_path: Path, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._info: xgr.TokenizerInfo | None = None
        self._info_json = ""
        self._idle: list[CompileProcess] = []  # children waiting for a compile
        self._started = False
        self._cache: OrderedDict[tuple[str, str], tuple[xgr.CompiledGrammar, int]] = \
            OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._lock:
            if self._info is None:
                from transformers import PreTrainedTokenizerFast

                tok = PreTrainedTokenizerFast(
                    tokenizer_file=str(self.tokenizer_path / "tokenizer.json"))
                self._info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
                self._info_json = self._info.serialize_json()
            return self._info

    def compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """The constraint's grammar; InvalidRequestError naming its field when it does not
        compile, or not within COMPILE_TIMEOUT_S (its child is then killed)."""
        key = (so.kind, so.spec)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit[0]
        info = self._tokenizer_info()
        child = self._take()
        try:
            text = child.compile(so.kind, so.spec, COMPILE_TIMEOUT_S)
        except CompileTimeout:
            raise InvalidRequestError(f"{so.field}: the constraint did not compile within "
                                      f"{COMPILE_TIMEOUT_S:g} s", so.field) from None
        except CompileError as exc:
            raise InvalidRequestError(f"{so.field}: {exc}", so.field) from None
        finally:
            self._give_back(child)
        grammar = xgr.CompiledGrammar.deserialize_json(text, info)
        self._remember(key, grammar, len(text))
        return grammar

    def child_pids(self) -> list[int]:
        """The idle children's process ids (tests watch a runaway's child go)."""
        with self._lock:
            return [c.pid for c in self._idle]

    def _take(self) -> CompileProcess:
        """An idle child; the first time, one per compile thread is started, so a second
        compile never waits for a child to start (~3 s) while a first one runs."""
        with self._lock:
            if not self._started:
                self._started = True
                self._idle += [CompileProcess(self._info_json, CACHE_BYTES)
                               for _ in range(COMPILE_THREADS)]
            if self._idle:
                return self._idle.pop()
        return CompileProcess(self._info_json, CACHE_BYTES)

    def _give_back(self, child: CompileProcess) -> None:
        """Back to the idle ones; a killed child is replaced at once, so its successor has
        started by the next compile."""
        if not child.alive:
            child = CompileProcess(self._info_json, CACHE_BYTES)
        with self._lock:
            self._idle.append(child)

    def _remember(self, key: tuple[str, str], grammar: xgr.CompiledGrammar, size: int) -> None:
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = (grammar, size)
            self._cached_bytes += size
            while self._cached_bytes > CACHE_BYTES and len(self._cache) > 1:
                _, (_, dropped) = self._cache.popitem(last=False)
                self._cached_bytes -= dropped


async def compile_in_thread(compile_: Callable[[SamplingParams], Any] | None,
                            params: SamplingParams) -> Any:
    """`compile_(params)` (an engine's `compile`) on the process's compile threads. The
    compile itself is stopped at COMPILE_TIMEOUT_S (its child is killed), and the request
    waits WAIT_TIMEOUT_S in all; past either, a 400. A compile still queued when its request
    gives up is dropped. None: the engine cannot constrain (a simulated one)."""
    params.validate()
    assert params.structured is not None
    if compile_ is None:
        raise InvalidRequestError(f"{params.structured.field}: structured outputs need a real "
                                  "model, not a simulated one", params.structured.field)
    try:
        running = asyncio.get_running_loop().run_in_executor(_COMPILE_POOL, compile_, params)
        return await asyncio.wait_for(running, WAIT_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise InvalidRequestError(f"{params.structured.field}: the compiler was busy; the "
                                  f"constraint was not compiled within {WAIT_TIMEOUT_S:g} s",
                                  params.structured.field) from None


def new_matcher(grammar: xgr.CompiledGrammar | None) -> xgr.GrammarMatcher | None:
    return None if grammar is None else xgr.GrammarMatcher(grammar)


def mask_logits(logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
    """Set the tokens each row's grammar refuses to -inf, in place (rows without one, or
    whose grammar has ended, are left alone)."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def accept(matchers: Sequence[xgr.GrammarMatcher | None], token_ids: Sequence[int]) -> None:
    """Advance each row's matcher by the token it sampled."""
    for m, tok in zip(matchers, token_ids, strict=True):
        if m is not None and not m.is_terminated():
            m.accept_token(tok)
