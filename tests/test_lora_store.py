"""Where a worker's LoRA adapters are: host copies bounded by `max_cpu_loras` unless in use,
batch slots bounded by `max_loras` with the least recently used evicted, never one a running
sequence uses; reads counted once, a changed folder refused. Adapters are small real ones."""

from __future__ import annotations

import pytest
import torch

from prefixserve.workers.lora import AdapterError, LoRAAdapter
from prefixserve.workers.lora_store import AdapterRef, LoRAStore


class Folders:
    """Adapters by folder: what `read` finds there (a test may change a folder's weights)."""

    def __init__(self) -> None:
        self.digests: dict[str, str] = {}
        self.reads: list[str] = []

    def read(self, name: str, path: str) -> LoRAAdapter:
        self.reads.append(path)
        if path not in self.digests:
            raise AdapterError(f"{path}/adapter_config.json is missing")
        pair = (torch.zeros(2, 4), torch.zeros(4, 2))
        return LoRAAdapter(name, self.digests[path], 2, [{"o": pair}])


def store(max_loras: int, max_cpu_loras: int, in_use: set[str] | None = None,
          ) -> tuple[LoRAStore, Folders]:
    folders = Folders()
    for k in range(5):
        folders.digests[f"/a{k}"] = f"d{k}"
    used = in_use if in_use is not None else set()
    return LoRAStore(folders.read, lambda: used, torch.device("cpu"), max_loras,
                     max_cpu_loras), folders


def test_slots_evict_the_least_recently_used_one_no_running_sequence_uses() -> None:
    s, _ = store(max_loras=2, max_cpu_loras=5)
    refs = [s.register(f"a{k}", f"/a{k}") for k in range(3)]
    ids = [r.identity for r in refs]
    assert ids == ["a0@d0", "a1@d1", "a2@d2"]
    s.activate([ids[0]], running=[ids[0]])
    s.activate([ids[1]], running=[ids[0], ids[1]])
    s.activate([ids[0]], running=[ids[0], ids[1]])  # a0 now the most recently used
    assert list(s.slots) == [ids[1], ids[0]]
    s.activate([ids[2]], running=[ids[2], ids[1]])  # a1 runs: a0 goes though used later
    assert list(s.slots) == [ids[1], ids[2]]
    st = s.stats()
    assert (st.loads, st.evictions, st.resident, st.max_loras) == (3, 1, tuple(s.slots), 2)
    assert st.load_s >= 0.0 and st.registered == 3 and st.reads == 3


def test_host_copies_past_the_bound_go_unless_a_request_uses_them() -> None:
    in_use: set[str] = set()
    s, folders = store(max_loras=1, max_cpu_loras=2, in_use=in_use)
    s.register("a0", "/a0")
    s.register("a1", "/a1")
    in_use.add("a0@d0")
    s.register("a2", "/a2")  # three held: a1, the oldest not in use, goes
    assert list(s.host) == ["a0@d0", "a2@d2"]
    s.hold(s.known["a1"])  # read again for a request
    assert folders.reads.count("/a1") == 2
    s.hold(s.known["a2"])  # held: no read
    assert folders.reads.count("/a2") == 1
    s.remove("a0")  # in use: its copy stays for the request
    assert "a0@d0" in s.host and "a0" not in s.known
    in_use.clear()
    s.remove("a2")
    assert "a2@d2" not in s.host


def test_a_folder_whose_weights_changed_is_refused_and_nothing_is_registered() -> None:
    s, folders = store(max_loras=1, max_cpu_loras=1)
    ref = s.register("a0", "/a0")
    folders.digests["/a0"] = "changed"
    s.host.clear()
    with pytest.raises(AdapterError, match="now a0@changed, not a0@d0"):
        s.hold(ref)
    with pytest.raises(AdapterError, match="missing"):
        s.register("x", "/nowhere")
    assert set(s.known) == {"a0"} and s.known["a0"] == AdapterRef("a0", "a0@d0", "/a0")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        store(max_loras=3, max_cpu_loras=2)
