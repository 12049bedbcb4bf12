"""Measure the real engine's step times and fit the simulated engine's linear cost model.

``python -m prefixserve.workers.sim.calibrate --model smollm2-135m-instruct`` runs a few
prefills (one request, ``max_tokens=1``) and decode steps (``batch`` sequences at a given
context) on the real :class:`workers.engine.LLMEngine`, times each engine step, and prints the
least-squares fit of

    prefill_s = p0 + p1 * tokens + p2 * tokens * context
    decode_s  = d0 + d1 * batch + d2 * batch * context

that :mod:`workers.sim.profiles` takes as a profile (the ``cpu-smollm2`` numbers came from here).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine import LLMEngine
from prefixserve.workers.engine_types import EngineConfig

PREFILLS = (64, 256, 512, 1024, 2048)
DECODES = ((1, 128), (4, 128), (16, 128), (1, 1024), (8, 1024), (32, 256))
DECODE_STEPS = 8


def _timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure(engine: LLMEngine, repeats: int) -> dict[str, list]:
    """(tokens, seconds) per prefill and (batch, context, seconds) per decode step."""
    rng = np.random.default_rng(0)
    vocab = min(engine.vocab_size, 30_000)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill: list[tuple[int, float]] = []
    for n in PREFILLS:
        for r in range(repeats):
            engine.add_request(f"p{n}-{r}", rng.integers(1, vocab, n).tolist(), one)
            seconds = 0.0
            while engine.has_unfinished():
                seconds += _timed_step(engine)
            prefill.append((n, seconds))
    decode: list[tuple[int, int, float]] = []
    many = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    for batch, context in DECODES:
        for b in range(batch):
            engine.add_request(f"d{batch}-{context}-{b}", rng.integers(1, vocab, context).tolist(),
                               many)
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()  # prefill every sequence first
        while engine.has_unfinished():
            running = len(engine.scheduler.running)
            seconds = _timed_step(engine)
            if running == batch:
                decode.append((batch, context, seconds))
        engine.reset_prefix_cache()
    return {"prefill": prefill, "decode": decode}


def fit(samples: dict[str, list]) -> dict[str, float]:
    """Least-squares coefficients of the two linear models (negative ones clipped to 0)."""
    p = np.array(samples["prefill"], dtype=float)
    a = np.stack([np.ones(len(p)), p[:, 0], p[:, 0] * p[:, 0] / 2], axis=1)
    pc = np.clip(np.linalg.lstsq(a, p[:, 1], rcond=None)[0], 0, None)
    d = np.array(samples["decode"], dtype=float)
    b = np.stack([np.ones(len(d)), d[:, 0], d[:, 0] * d[:, 1]], axis=1)
    dc = np.clip(np.linalg.lstsq(b, d[:, 2], rcond=None)[0], 0, None)
    names = ("prefill_base_s", "prefill_per_token_s", "prefill_per_token_context_s",
             "decode_base_s", "decode_per_seq_s", "decode_per_context_token_s")
    return dict(zip(names, (*pc.tolist(), *dc.tolist()), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    import torch

    from prefixserve.workers.checkpoints import resolve_checkpoint

    torch.set_num_threads(args.threads)
    config = EngineConfig(num_blocks=1024, max_num_batched_tokens=2048, device="cpu")
    engine = LLMEngine.from_pretrained(resolve_checkpoint(args.model), config)
    samples = measure(engine, args.repeats)
    print(json.dumps({"samples": samples, "fit": fit(samples)}, indent=1))


if __name__ == "__main__":
    main()
