"""Paged attention over the one preallocated KV tensor, behind a backend seam.

`metadata.AttentionMetadata` says where a step's tokens live in the cache (built once per step,
backend-neutral); `base.AttentionBackend` is what the model calls in every layer; `registry`
picks the backend for a device. Today's torch SDPA path (`torch_sdpa`) is the CPU and default
backend; paged GPU kernels (FlashAttention, FlashInfer, Triton) plug in as further backends.
"""
