"""Scheduler decisions, exactly: prefill/decode accounting, counters, backlog, retirement."""

from __future__ import annotations

from prefixserve.router.blocks import BlockHasher
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.kv_cache import KVCacheManager
from prefixserve.workers.scheduler import Scheduler, SchedulerOutput, SeqStatus, Sequence

BS = 4
NS = b"\x01" * 16


def seq(name: str, n: int, first: int = 0, request: str | None = None) -> Sequence:
    """A waiting sequence with an ``n``-token prompt ``first, first + 1, ...``."""
    tokens = list(range(first, first + n))
    hasher = BlockHasher(BS, NS)
    hasher.append(tokens)
    return Sequence(name, request or name, 0, tokens, n, SamplingParams(), hasher)


def advance(out: SchedulerOutput, sample: int = 7) -> None:
    """Pretend the forward pass ran: count the tokens, append a sample where a row is done."""
    for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(sample)


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 100) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget)


def test_sequence_views() -> None:
    s = seq("a", 9)
    assert s.num_tokens == 9 and s.num_output_tokens == 0
    assert s.hashes == s.hasher.hashes and len(s.hashes) == 2
    assert s.status is SeqStatus.WAITING and s.num_cached_tokens == -1
    s.append_token(5)
    s.append_token(6)
    s.append_token(7)
    assert s.token_ids[-3:] == [5, 6, 7]
    assert s.num_tokens == 12 and s.num_output_tokens == 3
    assert len(s.hashes) == 3  # the appended tokens completed block 2
    assert SchedulerOutput([], []).empty and not SchedulerOutput([s], [1]).empty


def test_new_scheduler_is_idle_and_counts_nothing() -> None:
    sched = scheduler()
    assert not sched.has_unfinished()
    assert sched.num_preemptions == 0
    assert sched.prompt_tokens_queried == 0 and sched.prompt_tokens_hit == 0
    assert sched.queued_prefill_tokens() == 0
    assert sched.schedule().empty


def test_has_unfinished_with_only_waiting_or_only_running() -> None:
    sched = scheduler()
    a = seq("a", 5)
    sched.add(a)
    assert list(sched.waiting) == [a] and sched.running == []
    assert sched.has_unfinished()
    advance(sched.schedule())
    assert sched.running == [a] and not sched.waiting
    assert sched.has_unfinished()
    sched.finish(a, "stop")
    assert not sched.has_unfinished()


def test_prefill_and_decode_token_accounting() -> None:
    sched = scheduler(budget=12)
    a, b, c = seq("a", 5), seq("b", 6, 100), seq("c", 9, 200)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # a whole (5), b whole (6), c a 1-token chunk: all prompt work, none of it decode
    assert out.num_new_tokens == [5, 6, 1]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (12, 0)
    advance(out)
    out = sched.schedule()
    # a and b decode one token each; c continues its prompt with the remaining 8
    assert [s.seq_id for s in out.seqs] == ["a", "b", "c"]
    assert out.num_new_tokens == [1, 1, 8]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (8, 2)
    advance(out)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 1, 1]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 3)


def test_last_prompt_token_alone_is_prefill() -> None:
    sched = scheduler(budget=4)
    a = seq("a", 5)
    sched.add(a)
    advance(sched.schedule())  # 4 of 5
    out = sched.schedule()
    assert out.num_new_tokens == [1]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 0)


def test_preempted_sequence_is_preempted_again_and_recomputes() -> None:
    kv = KVCacheManager(7, BS, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, x, b = seq("a", 4), seq("x", 4, 50), seq("b", 4, 100)
    for s in (a, x, b):
        sched.add(s)
    preempted_at: list[int] = []
    for step in range(11):
        out = sched.schedule()
        if out.preempted:
            assert out.preempted == [b]  # always the newest running sequence
            preempted_at.append(step)
            if x.status is SeqStatus.RUNNING:
                sched.finish(x, "stop")  # makes room for b to come back
        if step == 6:
            # b recomputes prompt + its 5 outputs: prefill work, though outputs exist
            assert out.seqs == [a, b] and out.num_new_tokens == [1, 9]
            assert b.num_output_tokens == 5
            assert (out.num_prefill_tokens, out.num_decode_tokens) == (9, 1)
        advance(out)
    assert preempted_at == [5, 10]
    assert b.num_preemptions == 2 and sched.num_preemptions == 2
    assert a.num_preemptions == 0 and x.num_preemptions == 0
    assert b.status is SeqStatus.WAITING and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and "b" not in kv.tables
    # its prompt was counted at its first admission only
    assert sched.prompt_tokens_queried == 12 and b.num_cached_tokens == 0


def test_recompute_after_a_full_prefix_hit_is_one_decode_row() -> None:
    kv = KVCacheManager(3, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", 4), seq("b", 4, 100)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # a, b: 1 block each, one token sampled each
    out = sched.schedule()  # both need a 2nd block, one is left: b (newest) is preempted
    assert out.preempted == [b] and out.seqs == [a]
    advance(out)
    sched.finish(a, "stop")
    out = sched.schedule()
    # b's prompt block is still cached: only its sampled token is recomputed
    assert out.seqs == [b] and out.num_new_tokens == [1]
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 0
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)


def test_prompt_hit_counters() -> None:
    sched = scheduler()
    a = seq("a", 10)
    sched.add(a)
    advance(sched.schedule())
    assert (sched.prompt_tokens_queried, sched.prompt_tokens_hit) == (10, 0)
    b = seq("b", 10)  # same prompt: blocks 0 and 1 are hits (block 2 holds its last token)
    sched.add(b)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert (sched.prompt_tokens_queried, sched.prompt_tokens_hit) == (20, 8)


def test_backlog_counts_every_running_prompt_left() -> None:
    sched = scheduler(budget=12)
    a, b = seq("a", 10), seq("b", 10, 100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.num_new_tokens == [10, 2]
    # the step failed (nothing advanced): both running prompts are still to compute
    assert sched.queued_prefill_tokens() == 20
    advance(out)
    # a is decoding (1 left: not prefill work); b has 8 left
    assert sched.queued_prefill_tokens() == 8


def test_backlog_counts_two_tokens_left() -> None:
    sched = scheduler(budget=8)
    a = seq("a", 10)
    sched.add(a)
    advance(sched.schedule())
    assert a.num_tokens - a.num_computed_tokens == 2
    assert sched.queued_prefill_tokens() == 2


def test_finish_running_and_waiting() -> None:
    sched = scheduler(budget=5)
    a, b, c = seq("a", 5), seq("b", 5, 100), seq("c", 5, 200)
    for s in (a, b, c):
        sched.add(s)
    advance(sched.schedule())  # a runs; b and c wait
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    sched.finish(b, "abort")
    assert list(sched.waiting) == [c] and sched.running == [a]
    assert b.status is SeqStatus.FINISHED and b.finish_reason == "abort"
    sched.finish(a, "length")
    assert sched.running == [] and list(sched.waiting) == [c]
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "length"
    assert "a" not in sched.kv.tables and sched.kv.num_free_blocks == 64


def test_drop_requests_retires_only_those_requests() -> None:
    sched = scheduler(budget=12)
    r1a, r1b = seq("r1a", 5, 0, "r1"), seq("r1b", 5, 100, "r1")
    r2, r3 = seq("r2", 5, 200, "r2"), seq("r3", 5, 300, "r3")
    for s in (r1a, r2, r1b, r3):
        sched.add(s)
    advance(sched.schedule())  # r1a, r2 run (10 of 12); r1b gets 2, r3 waits
    assert sched.running == [r1a, r2, r1b] and list(sched.waiting) == [r3]
    r2.status, r2.finish_reason = SeqStatus.FINISHED, "stop"  # finished by the failed step
    sched.drop_requests({"r1", "r2"})
    assert sched.running == [] and list(sched.waiting) == [r3]
    assert [s.finish_reason for s in (r1a, r1b, r2)] == ["abort", "abort", "stop"]
    assert all(s.status is SeqStatus.FINISHED for s in (r1a, r1b, r2))
    assert r3.status is SeqStatus.WAITING and r3.finish_reason is None
    assert sched.kv.tables == {} and sched.kv.num_free_blocks == 64
    sched.add(seq("r4", 5, 400, "r4"))
    advance(sched.schedule())
    sched.drop_requests({"r3"})
    assert [s.seq_id for s in sched.running] == ["r4"] and not sched.waiting
    assert list(sched.kv.tables) == ["r4"]


def test_remove_finished_keeps_the_others_in_order() -> None:
    sched = scheduler()
    seqs = [seq(f"s{i}", 3, 10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    advance(sched.schedule())
    sched.remove_finished(set())
    assert sched.running == seqs
    sched.remove_finished({seqs[1], seqs[3]})
    assert sched.running == [seqs[0], seqs[2]]


def fork(sched: Scheduler, parent: Sequence) -> list[Sequence]:
    """What the engine does when an n > 1 prompt finishes: n - 1 running siblings share its
    blocks (workers.engine_core.EngineCore._fork)."""
    parent.forked = True
    children = []
    for index in range(1, parent.params.n):
        child = Sequence(f"{parent.seq_id}#{index}", parent.request_id, index,
                         list(parent.token_ids), parent.num_prompt_tokens, parent.params,
                         BlockHasher(BS, NS), parent.num_computed_tokens,
                         parent.num_cached_tokens, SeqStatus.RUNNING, forked=True)
        child.hasher.append(child.token_ids)
        sched.kv.fork(parent.seq_id, child.seq_id)
        sched.running.append(child)
        children.append(child)
    return children


def test_budget_smaller_than_the_running_set() -> None:
    sched = scheduler(budget=2)
    a = seq("a", 2)
    a.params = SamplingParams(n=4)
    sched.add(a)
    out = sched.schedule()
    assert out.seqs == [a] and out.num_new_tokens == [2]
    a.num_computed_tokens = 2
    family = [a, *fork(sched, a)]
    for i, s in enumerate(family):
        s.append_token(50 + i)
    out = sched.schedule()
    # two decode tokens fill the budget: the other two siblings wait for the next step
    assert out.seqs == family[:2] and out.num_new_tokens == [1, 1]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 2)


def test_running_decodes_shrink_the_prefill_budget() -> None:
    sched = scheduler(budget=8)
    a, b = seq("a", 3), seq("b", 20, 100)
    sched.add(a)
    advance(sched.schedule())
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 7]
    advance(out)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 7]


def test_fanout_of_a_fresh_request_must_fit_max_num_seqs() -> None:
    sched = scheduler(max_num_seqs=4)
    sched.add(seq("a", 3))
    advance(sched.schedule())
    b = seq("b", 3, 100)
    b.params = SamplingParams(n=4)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == ["a"] and list(sched.waiting) == [b]
    # alone it is admitted even though it will take all four slots
    sched.finish(sched.running[0], "stop")
    out = sched.schedule()
    assert out.seqs == [b]


def test_a_waiting_forked_sample_takes_one_slot() -> None:
    sched = scheduler(max_num_seqs=4)
    for i in range(3):
        sched.add(seq(f"s{i}", 3, 10 * i))
    advance(sched.schedule())
    child = seq("c#1", 3, 100)
    child.params, child.forked = SamplingParams(n=4), True  # a preempted sibling
    sched.add(child)
    out = sched.schedule()
    assert out.seqs[-1] is child and len(sched.running) == 4


def test_lone_sequence_that_cannot_grow_ends_the_step() -> None:
    kv = KVCacheManager(3, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    a, b = seq("a", 20), seq("b", 3, 100)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # a: 8 tokens in 2 blocks; b waits (no budget left)
    out = sched.schedule()  # a's next chunk needs 2 blocks, 1 is free: a is too long
    assert out.too_long == [a] and out.seqs == [] and out.preempted == []
    # nothing else is admitted in that step, though b would fit
    assert sched.running == [] and list(sched.waiting) == [b]
    assert kv.block_ids("a") == [0, 1]  # the engine retires it (and frees its blocks)


def test_waiting_sequence_that_does_not_fit_stays_queued() -> None:
    kv = KVCacheManager(2, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", 3), seq("b", 9, 100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a] and list(sched.waiting) == [b]
    assert b.status is SeqStatus.WAITING and b.num_cached_tokens == -1
    assert "b" not in kv.tables
    assert sched.prompt_tokens_queried == 3


def test_prefix_hits_are_shared_and_counted() -> None:
    kv = KVCacheManager(16, BS)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    a = seq("a", 10)
    sched.add(a)
    advance(sched.schedule())
    b, c = seq("b", 10), seq("c", 13)
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert out.seqs == [a, b, c] and out.num_new_tokens == [1, 2, 5]
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2] == kv.block_ids("c")[:2] == [0, 1]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    assert kv.num_free_blocks == 16 - 3 - 1 - 2
    assert (sched.prompt_tokens_queried, sched.prompt_tokens_hit) == (33, 16)


def tenant(name: str, who: str | None, first: int) -> Sequence:
    s = seq(name, 3, first)
    s.tenant = who
    return s


def test_fair_admission_counts_each_admission() -> None:
    sched = scheduler()
    sched.add(tenant("a1", "A", 0))
    sched.add(tenant("b1", "B", 100))
    advance(sched.schedule())  # running: A 1, B 1
    a2, a3, b2 = tenant("a2", "A", 200), tenant("a3", "A", 300), tenant("b2", "B", 400)
    for s in (a2, a3, b2):
        sched.add(s)
    out = sched.schedule()
    # tie (1 each): the oldest, a2; then B runs fewer (1 < 2): b2; then a3
    assert [s.seq_id for s in out.seqs] == ["a1", "b1", "a2", "b2", "a3"]


def test_fair_admission_considers_untagged_requests_too() -> None:
    sched = scheduler()
    for i in range(2):
        sched.add(tenant(f"a{i}", "A", 10 * i))
    sched.add(tenant("b0", "B", 100))
    advance(sched.schedule())  # running: A 2, B 1, untagged 0
    for s in (tenant("a9", "A", 200), tenant("b9", "B", 300), tenant("n", None, 400)):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs][3:] == ["n", "b9", "a9"]


def test_the_output_carries_each_scheduled_sequences_block_table() -> None:
    """All the model runner reads of the KV manager: the blocks, in the batch's order."""
    sched = scheduler(budget=12)
    a, b = seq("a", 9), seq("b", 6, first=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == ["a", "b"] and out.num_new_tokens == [9, 3]
    assert len(out.tables) == 2
    assert out.tables[0] is sched.kv.tables["a"] and len(out.tables[0]) == 3  # 9 tokens
    assert out.tables[1] is sched.kv.tables["b"] and len(out.tables[1]) == 1  # 3 of 6
    advance(out)
    out = sched.schedule()  # a decodes, b finishes its prompt
    assert [len(t) for t in out.tables] == [3, 2]
    assert [t is sched.kv.tables[s.seq_id] for t, s in zip(out.tables, out.seqs,
                                                           strict=True)] == [True, True]
