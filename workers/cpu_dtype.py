"""What ``dtype: auto`` means on a CPU: bfloat16 where the CPU multiplies it natively (AMX tiles,
or AVX512-BF16), float32 elsewhere, where oneDNN's bf16 matmuls run ~40x slower than fp32.

``PREFIXSERVE_CPU_DTYPE`` (``float32`` or ``bfloat16``) overrides the choice for the process and
the Ray workers it starts: the test suite pins float32, so that its exact parity with
transformers holds on every CPU.
"""

from __future__ import annotations

import os

CPU_DTYPE_ENV = "PREFIXSERVE_CPU_DTYPE"
_CHOICES = ("float32", "bfloat16")


def cpu_auto_dtype() -> tuple[str, str]:
    """The dtype ``auto`` picks on this CPU, and why (for the start-up log)."""
    forced = os.environ.get(CPU_DTYPE_ENV, "")
    if forced:
        if forced not in _CHOICES:
            raise ValueError(f"{CPU_DTYPE_ENV} must be one of {', '.join(_CHOICES)}, "
                             f"got {forced!r}")
        return forced, f"{CPU_DTYPE_ENV}={forced}"
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "bfloat16", "the CPU has AMX tiles"
    if torch.cpu._is_avx512_bf16_supported():
        return "bfloat16", "the CPU has AVX512-BF16"
    return "float32", "the CPU has neither AMX nor AVX512-BF16 (bf16 matmuls would be slow)"
