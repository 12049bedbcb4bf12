"""LLMEngine: token-in / token-out generation with continuous batching and prefix caching.

One step = schedule (scheduler.py) → copy-on-write copies → one forward pass over every
scheduled token (model_runner.py) → sample → append, stop checks, fork ``n > 1`` samples →
deliver the step's KV events to ``on_kv_events``. Single-threaded: the replica drives it from
one loop thread.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from router import blocks
from router.events import KVEvent
from router.request import TokenLogprob
from workers.checkpoints import checkpoint_fingerprint
from workers.engine_types import (
    RATE_SMOOTHING,
    EngineConfig,
    EngineStats,
    GenerateOutput,
    RequestOutput,
    SampleOutput,
)
from workers.errors import InvalidRequestError, StepFailedError
from workers.kv_cache import KVCacheManager
from workers.kv_tensor import (
    allocate_kv_cache,
    blocks_for_budget,
    copy_blocks,
    fit_max_model_len,
    kv_bytes_per_token,
    log_kv_budget,
)
from workers.logits_processors import TokenHistory, needs_history
from workers.model_runner import ModelRunner, keep_cpu_heap
from workers.models.base import CausalLM
from workers.models.loader import load_model, resolve_device
from workers.request_checks import checked_request
from workers.sampling import Sampler, SamplingParams, make_generator
from workers.scheduler import Scheduler, SchedulerOutput, SeqStatus, Sequence

log = logging.getLogger(__name__)



@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    stop_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)
    num_done: int = 0


class LLMEngine:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        model_fingerprint: str,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        mc = model.config
        self.config = config
        self.model = model
        self.model_config = mc
        self.block_size = config.block_size
        self.model_fingerprint = model_fingerprint
        self.vocab_size = mc.vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(mc.eos_token_ids)
        if config.max_model_len is not None and config.max_model_len > mc.max_model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's {mc.max_model_len}"
            )
        self.on_kv_events = on_kv_events
        device = next(model.parameters()).device
        self.dtype = config.dtype_for(device.type)
        per_token = kv_bytes_per_token(mc, self.dtype)
        num_blocks = config.num_blocks or blocks_for_budget(
            config.kv_cache_memory_bytes, per_token, config.block_size, device,
            config.gpu_memory_utilization,
        )
        self.max_model_len = fit_max_model_len(
            config.max_model_len, mc.max_model_len, num_blocks, config.block_size
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_cache = allocate_kv_cache(mc, num_blocks, config.block_size, self.dtype, device)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv_cache, self.kv)
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, delivered by the next step
        self._ns_cache: dict[str | None, bytes] = {}
        self._prefill_rate = 0.0
        self._decode_rate = 0.0
        log_kv_budget(mc, self.dtype, per_token, num_blocks, config.block_size)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
    ) -> LLMEngine:
        config = config or EngineConfig()
        device = resolve_device(config.device)
        if device.type == "cpu":
            keep_cpu_heap()
        model = load_model(path, config.dtype_for(device.type), device)
        fingerprint = config.model_fingerprint or checkpoint_fingerprint(path)
        return cls(model, config, fingerprint, on_kv_events)

    def namespace(self, cache_salt: str | None) -> bytes:
        ns = self._ns_cache.get(cache_salt)
        if ns is None:
            ns = blocks.namespace(self.model_fingerprint, cache_salt)
            if len(self._ns_cache) < 1024:
                self._ns_cache[cache_salt] = ns
        return ns

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError (and changes nothing) on bad input.

        ``tenant`` is whose fair share of the batch the request uses (see workers.scheduler).
        """
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request_id {request_id!r}")
        prompt = checked_request(prompt_token_ids, sampling_params, cache_salt, tenant,
                                 self.max_model_len, self.vocab_size)
        stop = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            stop.update(self.eos_token_ids)
        req = _Request(request_id, sampling_params, len(prompt), frozenset(stop))
        hasher = blocks.BlockHasher(self.block_size, self.namespace(cache_salt))
        hasher.append(prompt)
        seq = Sequence(
            seq_id=f"{request_id}#0",
            request_id=request_id,
            index=0,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=sampling_params,
            hasher=hasher,
            tenant=tenant,
        )
        seq.extra["gen"] = make_generator(sampling_params, 0, self.kv_cache.device)
        req.seqs.append(seq)
        self._requests[request_id] = req
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; its samples report "abort" next step."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
                self._pending.append(self._output(req, seq, [], None))
                if not seq.forked:
                    self._pending.extend(self._unborn(req, seq))

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one step; if it raises, :meth:`_fail_step` leaves the engine exact and clean."""
        outputs, self._pending = self._pending, []
        sched: SchedulerOutput | None = None
        try:
            sched = self.scheduler.schedule()
            for seq in sched.too_long:
                self._retire(seq, "length", outputs, [], None)
            if not sched.empty:
                copies = self.kv.take_copies()
                if copies:
                    copy_blocks(self.kv_cache, copies)
                start = time.perf_counter()
                logits, sampled = self.runner.execute(sched)
                for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
                    seq.num_computed_tokens += n
                if logits is not None:
                    self._sample_and_append(logits, sampled, outputs)
                self._update_rates(sched, time.perf_counter() - start)
            self.kv.commit_step()
        except Exception as exc:
            failed = self._fail_step(sched)
            self._pending = [o for o in outputs if o.request_id not in failed]
            raise StepFailedError(failed) from exc
        finally:
            self._flush_events()
        return outputs

    def _fail_step(self, sched: SchedulerOutput | None) -> tuple[str, ...]:
        """Drop the failed step's requests (every request if scheduling itself failed) and
        unregister the blocks it hashed, whose KV was never written; returns the dropped ids."""
        if sched is None:
            failed = tuple(self._requests)
        else:
            failed = tuple(dict.fromkeys(seq.request_id for seq in sched.seqs))
        self.kv.rollback_step()
        self.scheduler.drop_requests(frozenset(failed))
        for request_id in failed:
            req = self._requests.pop(request_id, None)
            for seq in req.seqs if req is not None else ():
                self.kv.free(seq.seq_id)  # no-op unless scheduling failed half-way
        return failed

    def _sample_and_append(
        self, logits: torch.Tensor, sampled: list[Sequence], outputs: list[RequestOutput]
    ) -> None:
        rows: list[int] = []
        targets: list[Sequence] = []
        for i, seq in enumerate(sampled):
            if not seq.forked and seq.params.n > 1:
                targets.extend(self._fork(seq))
                rows.extend([i] * seq.params.n)
            else:
                targets.append(seq)
                rows.append(i)
        if len(rows) != len(sampled):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        params = [s.params for s in targets]
        gens = [s.extra["gen"] for s in targets]
        histories = None
        if any(needs_history(p) for p in params):
            histories = [self._history(s) if needs_history(s.params) else None for s in targets]
        token_ids, logprobs = self.sampler.sample(logits, params, gens, histories)
        done: set[Sequence] = set()
        for seq, tok, lp in zip(targets, token_ids, logprobs, strict=True):
            req = self._requests[seq.request_id]
            seq.append_token(tok)
            reason = None
            if tok in req.stop_ids:
                reason = "stop"
            elif (
                seq.num_output_tokens >= req.params.max_tokens
                or seq.num_tokens >= self.max_model_len
            ):
                reason = "length"
            lps = None if lp is None else [lp]
            if reason is None:
                outputs.append(self._output(req, seq, [tok], lps))
            else:
                self._retire(seq, reason, outputs, [tok], lps)
                done.add(seq)
        self.scheduler.remove_finished(done)

    def _history(self, seq: Sequence) -> TokenHistory:
        """The sequence's TokenHistory, made at its first penalized step and kept (it caches the
        prompt's ids on the device)."""
        history = seq.extra.get("history")
        if history is None:
            stop_ids = self._requests[seq.request_id].stop_ids
            history = TokenHistory(seq.token_ids, seq.num_prompt_tokens, stop_ids)
            seq.extra["history"] = history
        return history

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split a finished prefill into its n samples, sharing every block (CoW on write)."""
        req = self._requests[parent.request_id]
        parent.forked = True
        family = [parent]
        for index in range(1, parent.params.n):
            child = Sequence(
                seq_id=f"{parent.request_id}#{index}",
                request_id=parent.request_id,
                index=index,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                params=parent.params,
                hasher=copy.deepcopy(parent.hasher),
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
                status=SeqStatus.RUNNING,
                forked=True,
                tenant=parent.tenant,
            )
            child.extra["gen"] = make_generator(parent.params, index, self.kv_cache.device)
            self.kv.fork(parent.seq_id, child.seq_id)
            self.scheduler.running.append(child)
            req.seqs.append(child)
            family.append(child)
        return family

    def _retire(
        self,
        seq: Sequence,
        reason: str,
        outputs: list[RequestOutput],
        tokens: list[int],
        lps: list[TokenLogprob] | None,
    ) -> None:
        """Finish one sample: free its blocks; the request ends with its last sample."""
        req = self._requests[seq.request_id]
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.seq_id)
        outputs.append(self._output(req, seq, tokens, lps))
        req.num_done += 1
        if not seq.forked:  # ended before its n > 1 samples were forked: they end with it
            outputs.extend(self._unborn(req, seq))
            req.num_done = req.params.n
        if req.num_done == req.params.n:
            del self._requests[seq.request_id]

    def _unborn(self, req: _Request, parent: Sequence) -> list[RequestOutput]:
        """Final outputs for samples 1..n-1 of a request whose parent never forked."""
        outs = []
        for index in range(1, req.params.n):
            out = self._output(req, parent, [], None)
            out.index = index
            outs.append(out)
        return outs

    @staticmethod
    def _output(
        req: _Request, seq: Sequence, tokens: list[int], lps: list[TokenLogprob] | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            index=seq.index,
            new_token_ids=tokens,
            new_logprobs=lps,
            finished=seq.status is SeqStatus.FINISHED,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
        )

    def _update_rates(self, sched: SchedulerOutput, seconds: float) -> None:
        if seconds <= 0:
            return
        a = RATE_SMOOTHING
        if sched.num_prefill_tokens:
            rate = sched.num_prefill_tokens / seconds
            self._prefill_rate = (
                rate if not self._prefill_rate else (a * rate + (1 - a) * self._prefill_rate)
            )
        if sched.num_decode_tokens:
            rate = sched.num_decode_tokens / seconds
            self._decode_rate = (
                rate if not self._decode_rate else (a * rate + (1 - a) * self._decode_rate)
            )

    def _flush_events(self) -> None:
        events = self.kv.take_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    # ----------------------------------------------------------------- offline & introspection

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        cache_salt: str | None = None,
    ) -> list[GenerateOutput]:
        """Run a batch to completion; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt")
        results: dict[str, GenerateOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
                rid = f"generate-{id(results)}-{i}"
                self.add_request(rid, prompt, p, cache_salt)
                results[rid] = GenerateOutput(
                    rid,
                    list(prompt),
                    0,
                    [
                        SampleOutput(j, [], None, [] if p.logprobs is not None else None)
                        for j in range(p.n)
                    ],
                )
            while any(rid in self._requests for rid in results):
                for out in self.step():
                    res = results.get(out.request_id)
                    if res is None:
                        continue
                    sample = res.samples[out.index]
                    sample.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs and sample.logprobs is not None:
                        sample.logprobs.extend(out.new_logprobs)
                    res.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        sample.finish_reason = out.finish_reason
        except BaseException:
            # all or nothing: withdraw this call's requests so the engine is reusable
            for rid in results:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in results]
            raise
        return list(results.values())

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            prompt_tokens_queried=s.prompt_tokens_queried,
            prompt_tokens_hit=s.prompt_tokens_hit,
            kv_usage=self.kv.usage,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            queued_prefill_tokens=s.queued_prefill_tokens(),
            prefill_tokens_per_s=self._prefill_rate,
            decode_tokens_per_s=self._decode_rate,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            num_preemptions=s.num_preemptions,
        )

    def cached_block_hashes(self) -> list[bytes]:
        return self.kv.cached_hashes()

    def reset_prefix_cache(self) -> None:
        """Drop every cached hash; ``AllBlocksCleared`` goes out at once."""
        self.kv.reset_prefix_cache()
        self._flush_events()
