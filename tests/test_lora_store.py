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
          ticks: list[float] | None = None) -> tuple[LoRAStore, Folders]:
    folders = Folders()
    for k in range(5):
        folders.digests[f"/a{k}"] = f"d{k}"
    used = in_use if in_use is not None else set()
    clock = iter(ticks or [0.0] * 100).__next__  # a slot load reads it at start and end
    return LoRAStore(folders.read, lambda: used, torch.device("cpu"), max_loras,
                     max_cpu_loras, clock), folders


def test_slots_evict_the_least_recently_used_one_no_running_sequence_uses() -> None:
    s, _ = store(max_loras=2, max_cpu_loras=5, ticks=[0, 2, 2, 3, 3, 3, 3, 4])
    assert s.stats().load_s == 0.0  # nothing loaded yet
    refs = [s.register(f"a{k}", f"/a{k}") for k in range(4)]
    ids = [r.identity for r in refs]
    assert ids == ["a0@d0", "a1@d1", "a2@d2", "a3@d3"]
    got = s.activate([ids[0]], running=[ids[0]])
    assert got == {ids[0]: s.slots[ids[0]]} and got[ids[0]].identity == ids[0]
    assert s.load_s == 2.0  # the first load's seconds
    s.activate([ids[1]], running=[ids[0], ids[1]])
    assert s.load_s == pytest.approx(0.2 * 1 + 0.8 * 2.0)  # then smoothed
    s.activate([ids[0]], running=[ids[0], ids[1]])  # a0 now the most recently used
    assert list(s.slots) == [ids[1], ids[0]]
    s.activate([ids[2]], running=[ids[2], ids[1]])  # a1 runs: a0 goes though used later
    assert list(s.slots) == [ids[1], ids[2]]
    s.activate([ids[3]], running=[ids[3], ids[2]])
    st = s.stats()
    assert (st.loads, st.evictions, st.resident, st.max_loras) == (4, 2, (ids[2], ids[3]), 2)
    assert st.load_s == s.load_s and st.registered == 4 and st.reads == 4


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
    s.host.clear()
    s.remove("a1")  # its host copy went already
    s.remove("nobody")
    assert set(s.known) == set()


def test_a_folder_whose_weights_changed_is_refused_and_nothing_is_registered() -> None:
    s, folders = store(max_loras=1, max_cpu_loras=1)
    ref = s.register("a0", "/a0")
    folders.digests["/a0"] = "changed"
    s.host.clear()
    with pytest.raises(AdapterError, match="now a0@changed, not a0@d0"):
        s.hold(ref)
    with pytest.raises(AdapterError, match="missing"):
        s.register("x", "/nowhere")
    folders.digests["/a1"] = "d1"
    with pytest.raises(AdapterError, match="now a1@d1, not a1@d9"):
        s.register("a1", "/a1", "a1@d9")  # not the weights the ingress named
    assert set(s.known) == {"a0"} and s.known["a0"] == AdapterRef("a0", "a0@d0", "/a0")
    with pytest.raises(ValueError, match=r"^max_cpu_loras must be >= max_loras$"):
        store(max_loras=3, max_cpu_loras=2)
