"""The merged-cache ceiling: one cluster-sized LRU pool taking the prompts in arrival order."""

from __future__ import annotations

from prefixserve.bench.sim.simulate import merged_ceiling
from prefixserve.router.blocks import hash_chain

A = list(range(9))  # 2 full blocks of 4 and one partial
B = list(range(100, 109))


def ceiling(prompts: list[list[int]], num_blocks: int) -> float:
    return merged_ceiling([hash_chain(p, 4) for p in prompts], [len(p) for p in prompts],
                          num_blocks, 4)


def test_a_repeat_hits_its_full_blocks() -> None:
    # A again: both full blocks hit (8 of 27 tokens over the three prompts)
    assert ceiling([A, B, A], 6) == 8 / 27
    # an extension hits the blocks A had: 8 of 9 + 13 tokens
    assert ceiling([A, [*A, 1, 2, 3, 4]], 100) == 8 / 22


def test_a_pool_too_small_evicts_least_recently_used() -> None:
    # three blocks hold one prompt: B evicts A before it comes back
    assert ceiling([A, B, A], 3) == 0.0


def test_no_reuse_no_hits_and_the_last_token_is_always_computed() -> None:
    assert ceiling([A, B], 100) == 0.0
    assert ceiling([A[:8], A[:8]], 100) == 4 / 16  # the block of the last token is recomputed


def test_a_reply_that_the_next_turn_resends_is_held_by_the_ceiling() -> None:
    # A's reply R (4 tokens) is resent by the next turn: the pool holds A+R after A, so the next
    # turn hits the blocks of A+R (12 tokens: 3 blocks), where A alone leaves only 2
    reply = [50, 51, 52, 53]
    turn2 = [*A, *reply, 7, 8, 9]
    chains = [hash_chain([*A, *reply], 4), hash_chain(turn2, 4)]
    lengths = [len(A), len(turn2)]
    held = merged_ceiling(chains, lengths, 100, 4, [len(A) + 4, len(turn2)])
    assert held == 12 / (9 + 16)
    assert ceiling([A, turn2], 100) == 8 / (9 + 16)
