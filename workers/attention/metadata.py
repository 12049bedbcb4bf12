"""Where a step's tokens live in the paged KV cache, independent of the attention backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache; built by the core side each step.

    Sequence i owns the flat rows `query_start_loc[i]:query_start_loc[i+1]`; its new tokens are
    the last `query_len` of its `context_lens[i]` tokens. All tensors are int64 on the model's
    device. `query_lens_cpu` / `context_lens_cpu` are optional host copies that save a
    device-to-host sync; they are derived from the tensors when left as None.
    """

    slot_mapping: torch.Tensor  # [T] block_id * block_size + offset of each new token's K/V
    query_start_loc: torch.Tensor  # [B+1] cumulative new-token counts
    context_lens: torch.Tensor  # [B] tokens of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0 (never read past context_lens)
    logits_indices: torch.Tensor  # [B'] flat rows whose logits are returned
    query_lens_cpu: list[int] | None = None
    context_lens_cpu: list[int] | None = None
    # What the attention backend builds once per step and reuses in every layer.
    backend_state: Any = field(default=None, init=False, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        logits_indices: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from plain lists; logits default to each sequence's last new token."""
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        if logits_indices is None:
            logits_indices = [end - 1 for end in qsl[1:]]
        width = max((len(b) for b in block_tables), default=0) or 1
        bt = torch.zeros(len(block_tables), width, dtype=torch.long)
        for i, row in enumerate(block_tables):
            bt[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        pos = new_positions(query_lens, context_lens)
        slots = bt[seq, pos // block_size] * block_size + pos % block_size

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        return cls(
            slot_mapping=dev(slots),
            query_start_loc=dev(torch.tensor(qsl, dtype=torch.long)),
            context_lens=dev(torch.tensor(context_lens, dtype=torch.long)),
            block_tables=dev(bt),
            logits_indices=dev(torch.tensor(logits_indices, dtype=torch.long)),
            query_lens_cpu=list(query_lens),
            context_lens_cpu=list(context_lens),
        )

    def positions(self) -> torch.Tensor:
        """Position of every new token (its index in its sequence): the model's `positions`."""
        return new_positions(*self.host_lens()).to(self.slot_mapping.device)

    def host_lens(self) -> tuple[list[int], list[int]]:
        """New-token and context lengths per sequence as host lists (synced once, then kept)."""
        if self.query_lens_cpu is None:
            self.query_lens_cpu = self.query_start_loc.diff().tolist()
        if self.context_lens_cpu is None:
            self.context_lens_cpu = self.context_lens.tolist()
        return self.query_lens_cpu, self.context_lens_cpu


def new_positions(query_lens: list[int], context_lens: list[int]) -> torch.Tensor:
    """Each new token's index in its sequence, flattened in row order."""
    q = torch.tensor(query_lens, dtype=torch.long)
    row_start = torch.cumsum(q, 0) - q
    first = torch.tensor(context_lens, dtype=torch.long) - q  # position of the first new token
    return torch.arange(int(q.sum())) + torch.repeat_interleave(first - row_start, q)
