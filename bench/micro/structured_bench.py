"""Structured outputs' cost in the engine: decode tokens/s of a batch of JSON-schema requests
against the same batch unconstrained, grammar compile time per schema, cold and cached, and a
runaway compile (a schema built to compile for ~45 s) beside decoding: when it is refused, a
compile beside it, and the unconstrained batch's pace meanwhile.

    python -m prefixserve.bench.micro.structured_bench            # the default real model
    python -m prefixserve.bench.micro.structured_bench --quick    # fewer requests and rounds

Both batches decode greedily from the same prompts; each unconstrained request ignores EOS and
runs to the length its constrained twin reached, so both batches have the same shape step by
step (a batch that thins out early decodes fewer tokens per second for that reason alone). The
two alternate (A B A B ...) and the median of each, and their ratio, are printed: the machine
is shared.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import threading
import time

from prefixserve.bench.load.machine import cpu_name
from prefixserve.router.sampling_params import SamplingParams, StructuredOutput
from prefixserve.workers.checkpoints import DEFAULT_MODEL, resolve_checkpoint
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.structured import COMPILE_TIMEOUT_S

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "country": {"type": "string", "maxLength": 40},
                                      "is_capital": {"type": "boolean"}},
     "required": ["name", "country", "is_capital"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"enum": ["news", "sport", "travel"]},
                 "maxItems": 3},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}},
                   "required": ["name"], "additionalProperties": False}},
     "required": ["title", "tags", "rating", "author"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "step": {"type": "integer", "minimum": 1, "maximum": 20},
        "done": {"type": "boolean"}}, "required": ["step", "done"],
        "additionalProperties": False}, "maxItems": 4},
]
# eight string patterns with a long bounded repetition: ~5 s each over SmolLM2's vocabulary
RUNAWAY = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"^([a-z{c}]{{3,40}}[0-9]{{2,9}}){{5,1000}}$"}
    for i, c in enumerate("ABCDEFGH")}, "required": [f"p{i}" for i in range(8)]}
TOPICS = ["Paris", "a football match", "a mountain trip", "the stock market", "a recipe",
          "a train delay", "a new phone", "a museum"]


def _prompts(tok_encode, count: int) -> list[list[int]]:
    return [tok_encode([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as "
                                                    "JSON."}]) for i in range(count)]


def _run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
         ) -> tuple[float, list[int]]:
    """Seconds for the batch, and each request's generated length."""
    eng.reset_prefix_cache()
    start = time.perf_counter()
    outs = eng.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, [len(o.samples[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 8, 2
    logging.basicConfig(level=logging.WARNING)
    from prefixserve.cluster.tokenizer import Tokenizer

    path = resolve_checkpoint(args.model)
    eng = LLMEngine.from_pretrained(path, EngineConfig(device="cpu", max_num_seqs=64))
    tok = Tokenizer(path)
    assert eng.grammars is not None
    print(f"model {args.model} on {platform.machine()} {cpu_name()}; {args.requests} requests, "
          f"max_tokens {args.max_tokens}, {args.rounds} rounds")

    # compile: the first includes the vocabulary tables, then each schema cold, then cached
    start = time.perf_counter()
    eng.grammars.compile(StructuredOutput("json", json.dumps(SCHEMAS[0])))
    print(f"first compile (vocabulary tables + schema 0): {time.perf_counter() - start:.3f} s")
    for i, schema in enumerate(SCHEMAS):
        so = StructuredOutput("json", json.dumps(schema, indent=i))  # new text: not cached
        cold = _timed(lambda so=so: eng.grammars.compile(so))
        cached = _timed(lambda so=so: eng.grammars.compile(so))
        print(f"schema {i}: compile cold {cold * 1e3:.2f} ms, cached {cached * 1e3:.3f} ms")

    prompts = _prompts(lambda m: tok.encode_chat(m), args.requests)
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=(
        StructuredOutput("json", json.dumps(SCHEMAS[i % len(SCHEMAS)])))) for i in range(
        len(prompts))]
    _, lengths = _run(eng, prompts, constrained)  # warm-up; sets the free run's lengths
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    rates: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", free), ("json schema", constrained)):
            seconds, made = _run(eng, prompts, params)
            rates[name].append(sum(made) / seconds)
    base = statistics.median(rates["unconstrained"])
    json_rate = statistics.median(rates["json schema"])
    print(f"decode tok/s (median of {args.rounds}): unconstrained {base:.1f}, json schema "
          f"{json_rate:.1f}; ratio {json_rate / base:.3f} (overhead {1 - json_rate / base:+.1%})")
    _runaway(eng, prompts, free, base)
    return 0


def _runaway(eng: LLMEngine, prompts: list[list[int]], free: list[SamplingParams],
             base: float) -> None:
    """A runaway compile on one compile slot: when it is refused, a cold compile on the other
    slot meanwhile, and the unconstrained batch's decode rate while it runs."""
    grammars = eng.grammars
    assert grammars is not None
    refused: list[float] = []

    def run_away() -> None:
        start = time.perf_counter()
        try:
            grammars.compile(StructuredOutput("json", json.dumps(RUNAWAY)))
        except InvalidRequestError:
            refused.append(time.perf_counter() - start)

    thread = threading.Thread(target=run_away)
    thread.start()
    time.sleep(0.5)
    fresh = StructuredOutput("json", json.dumps(SCHEMAS[1], indent=7))  # not cached
    beside = _timed(lambda: grammars.compile(fresh))
    seconds, made = _run(eng, prompts, free)
    thread.join()
    rate = sum(made) / seconds
    print(f"runaway compile: refused after {refused[0]:.1f} s (limit {COMPILE_TIMEOUT_S:g} s); "
          f"a cold compile beside it {beside * 1e3:.1f} ms; unconstrained decode meanwhile "
          f"{rate:.1f} tok/s, ratio {rate / base:.3f} to the median above")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
