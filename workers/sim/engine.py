"""A simulated engine: the real scheduler and KV bookkeeping, modelled time instead of a model.

:class:`SimEngine` offers the methods ``LLMWorker`` and the engine loop use of
:class:`workers.engine.LLMEngine` (``add_request``, ``step``, ``abort``, ``has_unfinished``,
``stats``, ``cached_block_hashes``, ``reset_prefix_cache``, ``namespace`` and the model
attributes), and runs the same :class:`workers.scheduler.Scheduler` over the same
:class:`workers.kv_cache.KVCacheManager` with the same block hashing. So its prefix hits, KV
events, preemptions and load are the real engine's for the same token streams; only the forward
pass is replaced by a cost model (:mod:`workers.sim.profiles`) and the sampler by a token
source. No tensors: a thousand of them fit in one process (``bench.simulate``).

Time: each step's modelled duration is ``last_step_s``. With ``sleep=True`` (a Serve replica)
``step`` sleeps it, so streams take modelled time; otherwise the caller owns the clock (the
tier-2 simulator advances a virtual one) and ``clock_s`` sums the steps.
"""

from __future__ import annotations

import copy
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from router import blocks
from router.events import KVEvent
from workers.engine_types import RATE_SMOOTHING, EngineConfig, EngineStats, RequestOutput
from workers.errors import InvalidRequestError
from workers.kv_cache import KVCacheManager
from workers.kv_tensor import fit_max_model_len
from workers.request_checks import checked_request
from workers.sampling import SamplingParams
from workers.scheduler import Scheduler, SchedulerOutput, SeqStatus, Sequence
from workers.sim.profiles import SimProfile

TokenSource = Callable[[Sequence], int]


def hashed_tokens(vocab_size: int) -> TokenSource:
    """Deterministic stand-in tokens per (request, sample, position): reproducible across
    processes (unlike ``hash()``) and cheap."""

    def next_token(seq: Sequence) -> int:
        key = zlib.crc32(f"{seq.request_id}#{seq.index}".encode())
        return (key * 2654435761 + seq.num_output_tokens * 40503) % vocab_size

    return next_token


@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    stop_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)
    num_done: int = 0


class SimEngine:
    """See the module docstring."""

    def __init__(
        self,
        profile: SimProfile,
        config: EngineConfig | None = None,
        on_kv_events: Callable[[list[KVEvent]], None] | None = None,
        *,
        sleep: bool = False,
        token_source: TokenSource | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size`` narrows the profile's (a served replica: its tokenizer's ids only)."""
        config = config or EngineConfig()
        self.profile = profile
        self.config = config
        self.block_size = config.block_size
        self.model_fingerprint = config.model_fingerprint or profile.fingerprint
        self.vocab_size = vocab_size or profile.vocab_size
        self.eos_token_ids: tuple[int, ...] = ()
        if config.max_model_len is not None and config.max_model_len > profile.max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"{profile.max_model_len}")
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif config.kv_cache_memory_bytes is not None:
            per_block = profile.kv_bytes_per_token * config.block_size
            num_blocks = max(1, config.kv_cache_memory_bytes // per_block)
        else:
            num_blocks = profile.default_num_blocks(config.block_size)
        self.max_model_len = fit_max_model_len(
            config.max_model_len, profile.max_model_len, num_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.on_kv_events = on_kv_events
        self.sleep = sleep
        self.next_token = token_source or hashed_tokens(self.vocab_size)
        self.last_step_s = 0.0
        self.clock_s = 0.0  # modelled time of every step so far
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []
        self._ns_cache: dict[str | None, bytes] = {}
        self._prefill_rate = 0.0
        self._decode_rate = 0.0

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
        """Queue a request; InvalidRequestError (nothing changed) on what the real one refuses."""
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request_id {request_id!r}")
        prompt = checked_request(prompt_token_ids, sampling_params, cache_salt, tenant,
                                 self.max_model_len, self.vocab_size)
        stop = frozenset(sampling_params.stop_token_ids)
        req = _Request(request_id, sampling_params, len(prompt), stop)
        hasher = blocks.BlockHasher(self.block_size, self.namespace(cache_salt))
        hasher.append(prompt)
        seq = Sequence(seq_id=f"{request_id}#0", request_id=request_id, index=0,
                       token_ids=prompt, num_prompt_tokens=len(prompt), params=sampling_params,
                       hasher=hasher, tenant=tenant)
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
                self._pending.append(self._output(req, seq, []))
                if not seq.forked:
                    self._pending.extend(self._unborn(req, seq))

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedule, "run" the batch (modelled time), append one token per finished row."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        for seq in sched.too_long:
            self._retire(seq, "length", outputs, [])
        self.last_step_s = 0.0
        if not sched.empty:
            self.kv.take_copies()  # copy-on-write of block contents: nothing to copy here
            seconds = self.step_seconds(sched)
            sampled = []
            for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
                seq.num_computed_tokens += n
                if seq.num_computed_tokens == seq.num_tokens:
                    sampled.append(seq)
            self._append(sampled, outputs)
            self._update_rates(sched, seconds)
            self.last_step_s = seconds
            self.clock_s += seconds
            if self.sleep:
                time.sleep(seconds)
        self.kv.commit_step()
        events = self.kv.take_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)
        return outputs

    def step_seconds(self, sched: SchedulerOutput) -> float:
        """The profile's time for this batch (call before the tokens are counted computed)."""
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            computed = seq.num_computed_tokens
            if n == 1 and computed + 1 == seq.num_tokens and seq.num_output_tokens:
                decodes.append(seq.num_tokens)
            else:
                prefills.append((n, computed))
        return self.profile.step_seconds(prefills, decodes)

    def _append(self, sampled: list[Sequence], outputs: list[RequestOutput]) -> None:
        targets: list[Sequence] = []
        for seq in sampled:
            if not seq.forked and seq.params.n > 1:
                targets.extend(self._fork(seq))
            else:
                targets.append(seq)
        done: set[Sequence] = set()
        for seq in targets:
            req = self._requests[seq.request_id]
            tok = self.next_token(seq)
            seq.append_token(tok)
            reason = None
            if tok in req.stop_ids and seq.num_output_tokens >= req.params.min_tokens:
                reason = "stop"
            elif (seq.num_output_tokens >= req.params.max_tokens
                  or seq.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is None:
                outputs.append(self._output(req, seq, [tok]))
            else:
                self._retire(seq, reason, outputs, [tok])
                done.add(seq)
        self.scheduler.remove_finished(done)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split a finished prefill into its n samples, sharing every block (as the real one)."""
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
                forked=True, tenant=parent.tenant)
            self.kv.fork(parent.seq_id, child.seq_id)
            self.scheduler.running.append(child)
            req.seqs.append(child)
            family.append(child)
        return family

    def _retire(self, seq: Sequence, reason: str, outputs: list[RequestOutput],
                tokens: list[int]) -> None:
        req = self._requests[seq.request_id]
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.seq_id)
        outputs.append(self._output(req, seq, tokens))
        req.num_done += 1
        if not seq.forked:
            outputs.extend(self._unborn(req, seq))
            req.num_done = req.params.n
        if req.num_done == req.params.n:
            del self._requests[seq.request_id]

    def _unborn(self, req: _Request, parent: Sequence) -> list[RequestOutput]:
        outs = []
        for index in range(1, req.params.n):
            out = self._output(req, parent, [])
            out.index = index
            outs.append(out)
        return outs

    @staticmethod
    def _output(req: _Request, seq: Sequence, tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, index=seq.index, new_token_ids=tokens,
            new_logprobs=None, finished=seq.status is SeqStatus.FINISHED,
            finish_reason=seq.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0))

    def _update_rates(self, sched: SchedulerOutput, seconds: float) -> None:
        if seconds <= 0:
            return
        a = RATE_SMOOTHING
        if sched.num_prefill_tokens:
            rate = sched.num_prefill_tokens / seconds
            self._prefill_rate = rate if not self._prefill_rate else (
                a * rate + (1 - a) * self._prefill_rate)
        if sched.num_decode_tokens:
            rate = sched.num_decode_tokens / seconds
            self._decode_rate = rate if not self._decode_rate else (
                a * rate + (1 - a) * self._decode_rate)

    # ----------------------------------------------------------------- introspection

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
        events = self.kv.take_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)
