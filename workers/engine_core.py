"""EngineCore: the request bookkeeping the real and the simulated engine share.

:class:`workers.engine.LLMEngine` and :class:`workers.sim.engine.SimEngine` run the same
:class:`workers.scheduler.Scheduler` over the same :class:`workers.kv_cache.KVCacheManager`
with the same block hashing, forking, stop checks and outputs; only how a step's tokens are
produced differs (a forward pass and a sampler, or a cost model and a token source). Keeping
that bookkeeping here, once, is what makes the simulator's prefix hits, KV events, preemptions
and load the real engine's for the same token streams.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixserve.router import blocks
from prefixserve.router.adapters import adapter_fingerprint, adapter_name
from prefixserve.router.events import KVEvent
from prefixserve.router.request import TokenLogprob
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.engine_types import (
    RATE_SMOOTHING,
    BusyShare,
    EngineConfig,
    EngineStats,
    LoRAStats,
    RequestOutput,
)
from prefixserve.workers.errors import InvalidRequestError, StepFailedError
from prefixserve.workers.kv_cache import KVCacheManager
from prefixserve.workers.kv_tensor import fit_max_model_len
from prefixserve.workers.request_checks import checked_request, stop_ids
from prefixserve.workers.scheduler import Scheduler, SchedulerOutput, SeqStatus, Sequence

if TYPE_CHECKING:
    from prefixserve.workers.kv_tiers.offload import TieredKV

# One appended token: the sample, its token id and (real engine, when asked) its logprob.
Pick = tuple[Sequence, int, TokenLogprob | None]


def check_max_model_len(requested: int | None, model_max: int) -> None:
    """Refuse a configured context the model cannot take (before any memory is sized)."""
    if requested is not None and requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's {model_max}")


@dataclass(eq=False)
class EngineRequest:
    """One request's samples; it ends when all ``params.n`` of them are done."""

    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    stop_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)
    num_done: int = 0
    grammar: Any = None  # the compiled constraint (workers/structured.py); None: free text
    lora: Any = None  # its LoRA adapter (workers/lora.py); None: the base model


class EngineCore:
    """Scheduler, KV manager, requests and the step; subclasses supply ``_execute``, how a
    scheduled batch's tokens are produced (see module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        model_fingerprint: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        model_max_len: int,
        num_blocks: int,
        on_kv_events: Callable[[list[KVEvent]], None] | None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.model_fingerprint = model_fingerprint
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.on_kv_events = on_kv_events
        self.max_model_len = fit_max_model_len(
            config.max_model_len, model_max_len, num_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_loras)
        self._requests: dict[str, EngineRequest] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, delivered by the next step
        self._ns_cache: dict[tuple[str | None, str | None], bytes] = {}
        self._prefill_rate = 0.0
        self._decode_rate = 0.0
        self._busy = BusyShare()
        self.tiers: TieredKV | None = None
        self.clock: Callable[[], float] = time.monotonic  # the tier-2 simulator's is virtual
        self.last_step_s = 0.0  # the last step's execution time (a simulated one's modelled)

    # ------------------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, append, commit, then the step's KV events. If it raises, the step
        is rolled back (:meth:`_fail_step`) and :class:`StepFailedError` names the requests it
        dropped; the engine is usable for the next step."""
        outputs, self._pending = self._pending, []
        sched: SchedulerOutput | None = None
        self.last_step_s = 0.0
        try:
            sched = self.scheduler.schedule()
            for seq in sched.too_long:
                self._retire(seq, "length", outputs, [])
            if not sched.empty:
                self.last_step_s = self._execute(sched, self.kv.take_copies(), outputs)
                self._update_rates(sched, self.last_step_s)
            elif self.scheduler.loading and self.scheduler.tiers is not None:
                self.scheduler.tiers.wait(0.005)  # nothing to run until a load lands
            self.kv.commit_step()
        except Exception as exc:
            failed = self._fail_step(sched)
            self._pending = [o for o in outputs if o.request_id not in failed]
            raise StepFailedError(failed) from exc
        finally:
            self._flush_events()
        return outputs

    def _execute(self, sched: SchedulerOutput, copies: list[tuple[int, int]],
                 outputs: list[RequestOutput]) -> float:
        """Produce the scheduled batch's tokens: count them computed, append the sampled ones
        to ``outputs`` (``_fork_sampled``, ``_append_tokens``); ``copies`` are the step's
        copy-on-write block copies. Returns the step's seconds."""
        raise NotImplementedError

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

    def attach_tiers(self, tiers: TieredKV) -> None:
        """Put KV tiers below the pool (workers.kv_tiers); what the disk tier already holds
        is announced with the first step's events."""
        self.tiers = self.scheduler.tiers = tiers
        tiers.announce()

    def namespace(self, cache_salt: str | None, adapter: str | None = None) -> bytes:
        """Block 0's namespace: the model (under the LoRA adapter `adapter`, its identity)
        and the request's salt."""
        key = (cache_salt, adapter)
        ns = self._ns_cache.get(key)
        if ns is None:
            ns = blocks.namespace(adapter_fingerprint(self.model_fingerprint, adapter),
                                  cache_salt)
            if len(self._ns_cache) < 1024:
                self._ns_cache[key] = ns
        return ns

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
        grammar: Any = None,
        lora: Any = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError (and changes nothing) on bad input.

        ``tenant`` is whose fair share of the batch the request uses (see workers.scheduler);
        ``grammar`` is its compiled structured-output constraint, if any; ``lora`` its LoRA
        adapter (anything with an ``identity``), if any: its blocks are that adapter's.
        """
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request_id {request_id!r}")
        prompt = checked_request(prompt_token_ids, sampling_params, cache_salt, tenant,
                                 self.max_model_len, self.vocab_size)
        req = EngineRequest(request_id, sampling_params, len(prompt),
                            stop_ids(sampling_params, self.eos_token_ids), grammar=grammar,
                            lora=lora)
        adapter = None if lora is None else lora.identity
        hasher = blocks.BlockHasher(self.block_size, self.namespace(cache_salt, adapter))
        hasher.append(prompt)
        seq = Sequence(seq_id=f"{request_id}#0", request_id=request_id, index=0,
                       token_ids=prompt, num_prompt_tokens=len(prompt), params=sampling_params,
                       hasher=hasher, tenant=tenant, adapter=adapter)
        self._init_seq(seq, req)
        req.seqs.append(seq)
        self._requests[request_id] = req
        self.scheduler.add(seq)

    def lora_for(self, identity: str, path: str | None = None) -> Any:
        """The adapter a request names by identity (`name@digest`); this engine has none."""
        raise InvalidRequestError(f"this model serves no LoRA adapters (asked for "
                                  f"{adapter_name(identity)!r})", "model")

    def _init_seq(self, seq: Sequence, req: EngineRequest) -> None:
        """Per-sample state a subclass keeps in ``seq.extra`` (the real one: its generator and
        its grammar's matcher)."""

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; its samples report "abort" next step."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
                self._pending.append(self._output(req, seq, []))
                if not seq.forked:
                    self._pending.extend(self._unborn(req, seq))

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending)

    # ----------------------------------------------------------------- appending tokens

    def _fork_sampled(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """The samples that take a token this step (an ``n > 1`` request forks at its first)
        and, for each, its row in ``sampled`` (the logits row it samples from)."""
        targets: list[Sequence] = []
        rows: list[int] = []
        for i, seq in enumerate(sampled):
            if not seq.forked and seq.params.n > 1:
                targets.extend(self._fork(seq))
                rows.extend([i] * seq.params.n)
            else:
                targets.append(seq)
                rows.append(i)
        return targets, rows

    def _append_tokens(self, picks: Iterable[Pick], outputs: list[RequestOutput]) -> None:
        """Append each pick's token, then stop / length checks; finished samples retire."""
        done: set[Sequence] = set()
        for seq, tok, lp in picks:
            req = self._requests[seq.request_id]
            seq.append_token(tok)
            reason = None
            if tok in req.stop_ids and self._may_stop(req, seq):
                reason = "stop"
            elif (seq.num_output_tokens >= req.params.max_tokens
                  or seq.num_tokens >= self.max_model_len):
                reason = "length"
            lps = None if lp is None else [lp]
            if reason is None:
                outputs.append(self._output(req, seq, [tok], lps))
            else:
                self._retire(seq, reason, outputs, [tok], lps)
                done.add(seq)
        self.scheduler.remove_finished(done)

    def _may_stop(self, req: EngineRequest, seq: Sequence) -> bool:
        """Whether a stop token ends the sample; the real sampler never draws one too early."""
        return True

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split a finished prefill into its n samples, sharing every block (CoW on write)."""
        req = self._requests[parent.request_id]
        parent.forked = True
        family = [parent]
        for index in range(1, parent.params.n):
            child = Sequence(
                seq_id=f"{parent.request_id}#{index}", request_id=parent.request_id,
                index=index, token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens, params=parent.params,
                hasher=copy.deepcopy(parent.hasher),
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens, status=SeqStatus.RUNNING,
                forked=True, tenant=parent.tenant, adapter=parent.adapter)
            self._init_seq(child, req)
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
        lps: list[TokenLogprob] | None = None,
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

    def _unborn(self, req: EngineRequest, parent: Sequence) -> list[RequestOutput]:
        """Final outputs for samples 1..n-1 of a request whose parent never forked."""
        outs = []
        for index in range(1, req.params.n):
            out = self._output(req, parent, [])
            out.index = index
            outs.append(out)
        return outs

    @staticmethod
    def _output(
        req: EngineRequest, seq: Sequence, tokens: list[int], lps: list[TokenLogprob] | None = None
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
        self._busy.add(seconds, self.clock())
        if sched.num_prefill_tokens:
            self._prefill_rate = _smoothed(self._prefill_rate, sched.num_prefill_tokens / seconds)
        if sched.num_decode_tokens:
            self._decode_rate = _smoothed(self._decode_rate, sched.num_decode_tokens / seconds)

    def _flush_events(self) -> None:
        events = self.kv.take_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    # ----------------------------------------------------------------- introspection

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            prompt_tokens_queried=s.prompt_tokens_queried,
            prompt_tokens_hit=s.prompt_tokens_hit,
            kv_usage=self.kv.usage,
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(s.loading),
            queued_prefill_tokens=s.queued_prefill_tokens(),
            prefill_tokens_per_s=self._prefill_rate,
            decode_tokens_per_s=self._decode_rate,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            num_preemptions=s.num_preemptions,
            num_empty_blocks=self.kv.num_empty_blocks,
            busy_share=self._busy.read(self.clock()),
            lora=self.lora_stats(),
            running_loras=_adapter_names(s.running),
            waiting_loras=_adapter_names(s.waiting),
            external_tokens_queried=s.external_tokens_queried,
            external_tokens_hit=s.external_tokens_hit,
            tiers=None if self.tiers is None else self.tiers.snapshot(),
            **({} if self.tiers is None else self.tiers.load_rates()),
        )

    def lora_stats(self) -> LoRAStats:
        """Where this engine's LoRA adapters are; this one serves none."""
        return LoRAStats()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block this worker holds, in any tier (what a resync states)."""
        below = self.tiers.hashes() if self.tiers is not None else ()
        return list(dict.fromkeys((*self.kv.cached_hashes(), *below)))

    def reset_prefix_cache(self) -> None:
        """Drop every cached hash, in every tier; ``AllBlocksCleared`` goes out at once."""
        self.kv.reset_prefix_cache()
        if self.tiers is not None:
            self.tiers.clear()
        self._flush_events()


def _smoothed(old: float, rate: float) -> float:
    """The exponentially smoothed rate after a step at `rate` (the first step's as it is)."""
    return rate if not old else RATE_SMOOTHING * rate + (1 - RATE_SMOOTHING) * old


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The LoRA adapters the sequences run under, sorted (vLLM's lora_requests_info)."""
    return tuple(sorted({adapter_name(s.adapter) for s in seqs if s.adapter is not None}))
