"""Structured outputs: a request's constraint compiled to a grammar, and each constrained
sample's matcher, whose token bitmask the engine applies to the logits before sampling.

Grammars are xgrammar's (as vLLM's and SGLang's): a JSON schema, a regular expression, a choice
among strings, an EBNF grammar or a structural tag becomes a `CompiledGrammar` against this
model's vocabulary.
The compiler, and its vocabulary tables, are built on the first constrained request, so an
engine that never sees one pays nothing; its cache of compiled grammars is bounded in bytes.
Compiling runs off the engine loop, on one thread per process, within a time limit.

Per sample, a `GrammarMatcher` follows the tokens sampled so far. At a step with constrained
samples, `mask_logits` sets every token their grammars refuse to -inf (stop tokens are allowed
only where the grammar may end), then each sampled token is accepted. A step without one does
nothing extra. Forks get fresh matchers (they fork before their first token); a preempted
sample keeps its matcher, and its recomputed prompt is not replayed through it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from prefixserve.router.sampling_params import SamplingParams, StructuredOutput
from prefixserve.workers.errors import InvalidRequestError

COMPILE_TIMEOUT_S = 10.0  # a constraint that takes longer to compile is refused (400)
CACHE_BYTES = 256 * 2**20  # compiled grammars kept, at most
# One thread compiles, for every engine in the process: xgrammar releases the GIL while it
# works, so it costs the engine one core at most, whatever clients send.
_COMPILE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary (thread-safe, cached)."""

    def __init__(self, tokenizer_path: Path, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                from transformers import PreTrainedTokenizerFast

                tok = PreTrainedTokenizerFast(
                    tokenizer_file=str(self.tokenizer_path / "tokenizer.json"))
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        """The constraint's grammar; InvalidRequestError naming its field when it does not
        compile."""
        compiler = self._get()
        try:
            if so.kind == "json":
                if not so.spec:
                    return compiler.compile_builtin_json_grammar()
                return compiler.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "choice":
                return compiler.compile_grammar(choice_grammar(so.spec))
            if so.kind == "structural_tag":
                return compiler.compile_structural_tag(structural_tag(so.spec))
            return compiler.compile_grammar(so.spec)
        except Exception as exc:  # xgrammar's parse and compile errors: the client's input
            raise InvalidRequestError(f"{so.field}: {_first_line(exc)}", so.field) from None


async def compile_in_thread(compile_: Callable[[SamplingParams], Any] | None,
                            params: SamplingParams) -> Any:
    """`compile_(params)` (an engine's `compile`) on the process's one compile thread, within
    COMPILE_TIMEOUT_S (waiting for the thread included); past it, a 400. A compile cannot be
    stopped once it runs: a runaway one finishes in the background, into the cache, and holds
    one core, never more (a schema of 20 strings of `maxLength` 200 compiles for ~54 s). A
    compile still queued when its request gives up is dropped. None: the engine cannot
    constrain (a simulated one)."""
    params.validate()
    assert params.structured is not None
    if compile_ is None:
        raise InvalidRequestError(f"{params.structured.field}: structured outputs need a real "
                                  "model, not a simulated one", params.structured.field)
    try:
        running = asyncio.get_running_loop().run_in_executor(_COMPILE_THREAD, compile_, params)
        return await asyncio.wait_for(running, COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise InvalidRequestError(f"{params.structured.field}: the constraint did not compile "
                                  f"within {COMPILE_TIMEOUT_S:g} s",
                                  params.structured.field) from None


def choice_grammar(spec: str) -> str:
    """EBNF for "exactly one of these strings" (`spec`: a JSON list of strings)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError:
        choices = None
    if not (isinstance(choices, list) and choices
            and all(isinstance(c, str) and c for c in choices)):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def structural_tag(spec: str) -> str:
    """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), as JSON text.
    vLLM's first shape, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`,
    becomes the format it stands for: free text, and after a trigger one of the tags, its
    content held to its schema."""
    tag = json.loads(spec)
    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object")
    if "structures" not in tag:
        return spec
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(structures, list) and isinstance(triggers, list) and all(
            isinstance(s, dict) and isinstance(s.get("begin"), str)
            and isinstance(s.get("end"), str) and isinstance(s.get("schema"), dict | bool)
            for s in structures)):
        raise ValueError("structures must be a list of {begin, schema, end} and triggers a "
                         "list of strings")
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": s["schema"]}}
            for s in structures]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags}})


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


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
