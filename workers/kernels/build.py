"""prefixserve's CPU kernels (`csrc/`), compiled once per machine into one module.

- `paged_decode.cpp`: decode attention over the paged KV cache (`attention.cpu_paged`).
- `layer_ops.cpp`: RMSNorm (with the residual add), RoPE and SwiGLU's activation, each one pass
  (`models.layers.CPULayerOps`).
- `small_linear.cpp`: linear layers at a decode step's few rows, one ordered pass over the
  weights (`models.layers.CPULayerOps.linear`).
- `int4_linear.cpp`: the same over int4 weights, with float activations
  (`models.quantization`).
- `tile_linear.cpp`: bf16 linear layers over weights packed into AMX's tile layout
  (`models.tile_linear`), on the tile unit or with AVX512-BF16's pair product; only where the
  CPU and compiler have one of them.
- `argmax.cpp`: each row's first largest value, greedy sampling's pick (`workers.sampling`).
- `vec.h`: what the vectorised ones share (the vector type, widening loads, a lane sum).

torch's extension builder compiles them with the host's C++ compiler for the CPU it runs on
(`-march=native`: AVX-512 or AVX2 vectors) into `<PREFIXSERVE_CACHE>/kernels/<name>`, where
the name is a digest of the sources, the flags, torch's version and the CPU's instruction set:
a changed source or another CPU gets its own build, never a stale or foreign one. A later
process imports the built library directly, in well under a second; processes building at once
wait on torch's lock. `make setup` builds it ahead (`python -m
prefixserve.workers.kernels.build`). Where it cannot be built (no compiler), CPU attention stays
torch SDPA and the layers torch's ops, with one log line saying why.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import time
from importlib import resources
from pathlib import Path
from types import ModuleType

from prefixserve.workers.cache import default_cache_dir

log = logging.getLogger(__name__)

# -ffast-math lets the compiler vectorise the softmax's exp (glibc's vector math) and reassociate
# the dot products' sums; every value the kernel sees is finite.
CFLAGS = ["-O3", "-march=native", "-ffast-math"]
# The kernels' at::parallel_for splits work over torch's threads only in a build with OpenMP;
# without it every kernel runs on the calling thread alone. The library links libgomp by its
# soname, which resolves to the runtime torch has already loaded: one thread pool, torch's.
OPENMP = ["-fopenmp"]
# A build's lock older than this was left by a process killed mid-build (torch's lock has no
# timeout of its own, so every later process would wait on it forever).
STALE_LOCK_S = 600.0


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags"))
    except (OSError, StopIteration):
        import platform

        return platform.machine() + platform.processor()


def source_files() -> list[Path]:
    folder = Path(str(resources.files("prefixserve.workers.kernels") / "csrc"))
    return sorted(folder.glob("*.cpp"))


def build_name(sources: list[Path]) -> str:
    """The build's name: it changes with the sources (and the headers beside them), the
    flags, torch and the CPU."""
    import torch

    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    key = b"\0".join([*(s.read_bytes() for s in [*sources, *headers]),
                      " ".join(CFLAGS + OPENMP).encode(),
                      torch.__version__.encode(), _cpu_flags().encode()])
    return f"prefixserve_cpu_kernels_{hashlib.sha256(key).hexdigest()[:16]}"


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, sources: list[Path], folder: Path) -> ModuleType:
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    # copies: torch's builder appends its own link flags to the list it is given
    return cpp_extension.load(name=name, sources=[str(s) for s in sources],
                              extra_cflags=[*CFLAGS, *OPENMP], extra_ldflags=[*OPENMP],
                              build_directory=str(folder), verbose=False)


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module (`paged_decode`, `max_head_dim`, `max_heads`, `vector_width`,
    `k_pairs`, `rms_norm`, `add_rms_norm_`, `rope_`, `silu_mul`, `small_linear`,
    `small_linear_max_rows`, `amx_tiles`, `tile_linear_engine`, `tile_pack`, `tile_linear`,
    `int4_linear`, `argmax_rows`, `parallel_threads`), or None where it cannot be built here."""
    started = time.perf_counter()
    try:
        sources = source_files()
        name = build_name(sources)
        folder = default_cache_dir() / "kernels" / name
        library = folder / f"{name}.so"
        built = library.exists() and not (folder / "lock").exists()
        module = _import(name, library) if built else _build(name, sources, folder)
    except Exception as exc:  # a build tool's failure of any kind: serve with torch's ops
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("CPU kernels unavailable, attention uses torch SDPA and the layers torch's "
                    "ops: %s", first)
        return None
    log.info("CPU kernels ready (%d-float vectors) in %.1f s",
             module.vector_width, time.perf_counter() - started)
    return module


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if cpu_kernels() is not None else 1)
