"""Where a worker replica runs: its Serve replica id, its Ray node, its device, its memory.

Each falls back to something sensible outside Ray/Serve, so a replica also runs offline (tests,
notebooks).
"""

from __future__ import annotations

import os
import uuid

import ray
from ray import serve


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (offline use): any unique name will do
        return f"local-{uuid.uuid4().hex[:8]}"


def node_id() -> str:
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:
        return ""


def rss_bytes() -> int:
    """Resident set size of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def device_for(requested: str) -> str:
    """``auto``: in a Ray actor, the GPU Ray assigned to it (else CPU); elsewhere any GPU."""
    if requested != "auto":
        return requested
    import torch

    in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if in_actor and not ray.get_gpu_ids():
        return "cpu"  # a GPU visible to a replica that did not ask for one is someone else's
    return "cuda" if torch.cuda.is_available() else "cpu"


def use_replica_cpus() -> int:
    """Size torch's CPU thread pool to the cores Ray gave this replica (at least one; outside
    Ray, left as torch found it), so that replicas sharing a node do not oversubscribe it;
    returns the threads in use."""
    import torch

    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU") \
            if ray.is_initialized() else None
    except Exception:  # not in a Ray worker
        cpus = None
    if cpus is not None:
        torch.set_num_threads(max(1, int(cpus)))
    return torch.get_num_threads()
