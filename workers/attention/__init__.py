"""Paged attention over the one preallocated KV tensor, behind a backend seam.

`metadata.AttentionMetadata` says where a step's tokens live in the cache (built once per step,
backend-neutral); `base.AttentionBackend` is what the model calls in every layer; `registry`
picks the backend for a device. On a CPU that is `cpu_paged` (a C++ paged-decode kernel,
`cpu_kernel` builds it) where the kernel builds; elsewhere, and as the fallback, torch SDPA
(`torch_sdpa`). Paged GPU kernels (FlashAttention, FlashInfer, Triton) plug in as further
backends.
"""
