"""Continuous batching without a model: token budget, chunking, admission, preemption order."""

from __future__ import annotations

from prefixserve.router.blocks import BlockHasher
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.kv_cache import KVCacheManager
from prefixserve.workers.scheduler import Scheduler, SeqStatus, Sequence

BS = 4


def seq(name: str, n: int, first: int = 0) -> Sequence:
    tokens = list(range(first, first + n))
    hasher = BlockHasher(BS, b"\x00" * 16)
    hasher.append(tokens)
    return Sequence(name, name, 0, tokens, n, SamplingParams(), hasher)


def run_step(sched: Scheduler, sample: int = 7) -> dict[str, int]:
    """Schedule, then pretend the forward pass ran: advance and append a token where due."""
    out = sched.schedule()
    for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(sample)
    return {s.seq_id: n for s, n in zip(out.seqs, out.num_new_tokens, strict=True)}


def test_token_budget_chunks_prefill_and_mixes_decodes() -> None:
    sched = Scheduler(KVCacheManager(64, BS), max_num_seqs=8, max_num_batched_tokens=16)
    a, b, c = seq("a", 10), seq("b", 10, 100), seq("c", 10, 200)
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched) == {"a": 10, "b": 6}  # b's prompt is chunked
    assert c.status is SeqStatus.WAITING
    assert sched.queued_prefill_tokens() == 4 + 10
    # a decodes while b finishes its prompt and c starts: one batch
    assert run_step(sched) == {"a": 1, "b": 4, "c": 10}
    assert run_step(sched) == {"a": 1, "b": 1, "c": 1}


def shared(name: str, prefix: int, tail: int, tail_first: int) -> Sequence:
    """A prompt of `prefix` tokens 0..prefix-1 (shared by every such sequence) and its own tail."""
    tokens = [*range(prefix), *range(tail_first, tail_first + tail)]
    hasher = BlockHasher(BS, b"\x00" * 16)
    hasher.append(tokens)
    return Sequence(name, name, 0, tokens, len(tokens), SamplingParams(), hasher)


def test_queued_backlog_leaves_out_the_prefix_waiting_prompts_will_hit() -> None:
    sched = Scheduler(KVCacheManager(64, BS), max_num_seqs=1, max_num_batched_tokens=100)
    sched.add(shared("first", 16, 6, 1000))
    run_step(sched)  # computes and caches the 16-token prefix (4 blocks)
    # Waiting behind it: two prompts on the cached prefix, then a new prefix twice (the second
    # hits what the first will compute), then one that matches only 2 cached blocks.
    for s in (shared("a", 16, 6, 2000), shared("b", 16, 3, 3000),
              seq("c", 12, 500), seq("d", 14, 500), shared("e", 9, 11, 4000)):
        sched.add(s)
    assert len(sched.waiting) == 5
    assert sched.queued_prefill_tokens() == 6 + 3 + 12 + (14 - 12) + (20 - 8)


def test_queued_backlog_counts_whole_prompts_without_prefix_caching() -> None:
    sched = Scheduler(KVCacheManager(64, BS, enable_caching=False), max_num_seqs=1,
                      max_num_batched_tokens=100)
    sched.add(shared("first", 16, 6, 1000))
    run_step(sched)
    sched.add(shared("a", 16, 6, 2000))
    sched.add(seq("c", 12, 500))
    sched.add(seq("d", 14, 500))
    assert sched.queued_prefill_tokens() == 22 + 12 + 14


def test_max_num_seqs_caps_admission() -> None:
    sched = Scheduler(KVCacheManager(64, BS), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(f"s{i}", 5, 10 * i))
    assert set(run_step(sched)) == {"s0", "s1"}
    assert len(sched.waiting) == 1


def test_newest_running_sequence_is_preempted_and_resumes_first() -> None:
    kv = KVCacheManager(6, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = seq("a", 8), seq("b", 7, 100), seq("c", 4, 200)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)  # a: 2 blocks (+token 8), b: 2 blocks, c: 1 block → 5 of 6 used
    assert kv.num_free_blocks == 1
    # a needs a 3rd block (takes the last), b fits in its 2nd, c needs a 2nd: c is preempted
    assert run_step(sched) == {"a": 1, "b": 1}
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0
    assert sched.waiting[0] is c and sched.num_preemptions == 1
    assert c.token_ids == [200, 201, 202, 203, 7]  # its output is now part of its prompt
    assert c.seq_id not in kv.tables
    assert kv.num_free_blocks == 1


def tenant_seq(name: str, tenant: str, n: int = 5, first: int = 0) -> Sequence:
    s = seq(name, n, first)
    s.tenant = tenant
    return s


def test_a_flooding_tenant_does_not_hold_another_tenants_request_behind_it() -> None:
    sched = Scheduler(KVCacheManager(256, BS), max_num_seqs=4, max_num_batched_tokens=100)
    for i in range(50):
        sched.add(tenant_seq(f"a{i}", "A", first=10 * i))
    sched.add(tenant_seq("b", "B", first=1000))
    # the tenant running fewer goes next; ties to the oldest: A, B, then A's queue in order
    assert list(run_step(sched)) == ["a0", "b", "a1", "a2"]


def test_a_late_tenant_takes_the_next_free_slot() -> None:
    sched = Scheduler(KVCacheManager(256, BS), max_num_seqs=2, max_num_batched_tokens=100)
    flood = [tenant_seq(f"a{i}", "A", first=10 * i) for i in range(50)]
    for s in flood:
        sched.add(s)
    assert list(run_step(sched)) == ["a0", "a1"]
    sched.add(tenant_seq("b", "B", first=1000))
    sched.add(tenant_seq("b2", "B", first=2000))
    assert list(run_step(sched)) == ["a0", "a1"]  # full: nobody is admitted
    sched.finish(flood[0], "stop")
    assert list(run_step(sched)) == ["a1", "b"]  # not a2, 48 requests ahead of b
    sched.finish(flood[1], "stop")
    assert list(run_step(sched)) == ["b", "a2"]  # A now runs fewer than B: FIFO within tenants


def test_one_tenant_is_plain_fifo() -> None:
    sched = Scheduler(KVCacheManager(256, BS), max_num_seqs=3, max_num_batched_tokens=100)
    queued = [tenant_seq(f"s{i}", "T", first=10 * i) for i in range(6)]
    for s in queued:
        sched.add(s)
    assert list(run_step(sched)) == ["s0", "s1", "s2"]
    sched.finish(queued[1], "stop")
    assert list(run_step(sched)) == ["s0", "s2", "s3"]
    assert list(sched.waiting) == queued[4:]


def test_a_preempted_sequence_resumes_before_a_less_served_tenant() -> None:
    kv = KVCacheManager(6, BS)
    sched = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=100)
    a, b, c = tenant_seq("a", "A", 8), tenant_seq("b", "A", 7, 100), tenant_seq("c", "A", 4, 200)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    d = tenant_seq("d", "B", 4, 300)
    sched.add(d)
    assert run_step(sched) == {"a": 1, "b": 1}  # c is preempted
    assert list(sched.waiting) == [c, d]
    sched.finish(a, "stop")
    # B runs nothing and A one, yet c keeps its place at the front as a preempted sequence
    assert list(run_step(sched)) == ["b", "c", "d"]


def adapter_seq(name: str, adapter: str | None, first: int) -> Sequence:
    s = seq(name, 5, first)
    s.adapter = adapter
    return s


def test_running_sequences_use_at_most_max_loras_adapters() -> None:
    """A sequence whose adapter would be one too many waits; those behind it (the base model,
    an adapter already running) go first, and it runs once a slot's requests finish."""
    sched = Scheduler(KVCacheManager(256, BS), max_num_seqs=8, max_num_batched_tokens=100,
                      max_loras=2)
    queued = [adapter_seq("x1", "x", 0), adapter_seq("y1", "y", 10), adapter_seq("z1", "z", 20),
              adapter_seq("base", None, 30), adapter_seq("x2", "x", 40)]
    for s in queued:
        sched.add(s)
    assert list(run_step(sched)) == ["x1", "y1", "base", "x2"]
    assert sched.running_adapters() == {"x", "y"} and list(sched.waiting) == [queued[2]]
    sched.finish(queued[0], "stop")
    assert list(run_step(sched)) == ["y1", "base", "x2"]  # x still runs (x2): z waits
    sched.finish(queued[4], "stop")
    assert list(run_step(sched)) == ["y1", "base", "z1"]
    assert sched.running_adapters() == {"y", "z"}


def test_a_preempted_sequence_whose_adapter_has_no_slot_lets_others_pass() -> None:
    sched = Scheduler(KVCacheManager(256, BS), max_num_seqs=8, max_num_batched_tokens=100,
                      max_loras=1)
    waiting, base = adapter_seq("w", "w", 0), adapter_seq("base", None, 10)
    waiting.num_preemptions = 1
    running = adapter_seq("r", "r", 20)
    sched.add(running)
    run_step(sched)
    sched.waiting.extend([waiting, base])
    assert list(run_step(sched)) == ["r", "base"]
    assert list(sched.waiting) == [waiting]


def test_without_max_loras_one_adapter_runs_at_a_time() -> None:
    sched = Scheduler(KVCacheManager(256, BS), max_num_seqs=8, max_num_batched_tokens=100)
    for s in (adapter_seq("x", "x", 0), adapter_seq("y", "y", 10)):
        sched.add(s)
    assert list(run_step(sched)) == ["x"]
