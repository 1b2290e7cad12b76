"""LoRAManager: the LRU bound, refcounts, ids, same-name reloads and unloads (a fake loader)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmesh.engine.lora.manager import LoRAManager
from kvmesh.engine.lora.request import LoRAError, LoRARequest


class FakeLoader:
    """Loads an adapter whose digest is the content of its "files" (a dict path -> digest)."""

    def __init__(self):
        self.files: dict[str, str] = {}
        self.calls = 0

    def __call__(self, req, model_config, max_rank):
        self.calls += 1
        if req.lora_path not in self.files:
            raise LoRAError(f"LoRA adapter {req.lora_name!r}: no adapter at {req.lora_path}")
        return SimpleNamespace(
            name=req.lora_name,
            int_id=req.lora_int_id,
            path=req.lora_path,
            digest=self.files[req.lora_path],
            rank=4,
            base_model_name=req.base_model_name,
        )


def _manager(max_loras=1, max_cpu_loras=2):
    loader = FakeLoader()
    for i in range(6):
        loader.files[f"/a{i}"] = f"d{i}"
    return LoRAManager(max_loras, max_cpu_loras, 16, None, loader=loader), loader


def test_loads_lists_and_removes():
    m, _ = _manager()
    m.load(LoRARequest("x", 7, "/a0", "base"))
    assert m.list() == [
        {"name": "x", "id": 7, "path": "/a0", "digest": "d0", "rank": 4, "base_model_name": "base"}
    ]
    assert m.get("x").int_id == 7
    assert m.remove("x") is True
    assert m.remove("x") is False
    assert m.list() == []
    with pytest.raises(LoRAError, match="'x' is not loaded"):
        m.get("x")


def test_evicts_the_least_recently_used_one_not_in_use():
    m, _ = _manager(max_cpu_loras=2)
    a = m.load(LoRARequest("a", 1, "/a0"))
    m.load(LoRARequest("b", 2, "/a1"))
    m.acquire(a)  # a is older but in use: b goes
    m.load(LoRARequest("c", 3, "/a2"))
    assert [e["name"] for e in m.list()] == ["a", "c"]
    m.release(a)
    m.get("a")  # a is now the most recently used: c goes
    m.load(LoRARequest("d", 4, "/a3"))
    assert [e["name"] for e in m.list()] == ["a", "d"]


def test_refuses_a_load_when_every_loaded_adapter_is_in_use():
    m, loader = _manager(max_cpu_loras=2)
    for name, path in (("a", "/a0"), ("b", "/a1")):
        m.acquire(m.load(LoRARequest(name, 0, path)))
    calls = loader.calls
    with pytest.raises(LoRAError, match="'c'.*in use"):
        m.load(LoRARequest("c", 0, "/a2"))
    assert loader.calls == calls  # refused before reading anything
    assert [e["name"] for e in m.list()] == ["a", "b"]


def test_a_failed_load_changes_nothing():
    m, _ = _manager(max_cpu_loras=1)
    m.load(LoRARequest("a", 0, "/a0"))
    with pytest.raises(LoRAError, match="no adapter"):
        m.load(LoRARequest("b", 0, "/missing"))
    assert [e["name"] for e in m.list()] == ["a"]


def test_refcounts_follow_acquire_and_release():
    m, _ = _manager()
    a = m.load(LoRARequest("a", 0, "/a0"))
    m.acquire(a)
    m.acquire(a)
    assert m.refcount(a) == 2
    m.release(a)
    assert m.refcount(a) == 1 and m.in_use(a)
    m.release(a)
    assert m.refcount(a) == 0 and not m.in_use(a)


def test_ids_given_assigned_and_kept_on_reload():
    m, loader = _manager(max_cpu_loras=4)
    assert m.load(LoRARequest("a", 2, "/a0")).int_id == 2
    assert m.load(LoRARequest("b", 0, "/a1")).int_id == 1
    assert m.load(LoRARequest("c", 0, "/a2")).int_id == 3  # 2 is taken
    with pytest.raises(LoRAError, match="id 2 is used by adapter 'a'"):
        m.load(LoRARequest("d", 2, "/a3"))
    loader.files["/a1"] = "d1-new"
    assert m.load(LoRARequest("b", 0, "/a1")).int_id == 1  # a reload keeps the name's id


def test_same_name_with_new_files_is_a_new_adapter_running_requests_keep_the_old():
    m, loader = _manager()
    old = m.load(LoRARequest("a", 1, "/a0"))
    m.acquire(old)
    same = m.load(LoRARequest("a", 1, "/a0"))
    assert same is old  # the same files: the same adapter
    loader.files["/a0"] = "changed"
    new = m.load(LoRARequest("a", 1, "/a0"))
    assert new is not old and new.digest == "changed" and old.digest == "d0"
    assert m.get("a") is new
    assert m.refcount(old) == 1 and m.refcount(new) == 0
    assert len(m) == 1


def test_removing_an_adapter_in_use_keeps_it_for_its_requests():
    m, _ = _manager()
    a = m.load(LoRARequest("a", 1, "/a0"))
    m.acquire(a)
    assert m.remove("a")
    assert "a" not in m
    with pytest.raises(LoRAError):
        m.get("a")
    assert m.refcount(a) == 1  # the running request still holds it
    m.release(a)
    assert m.refcount(a) == 0


@pytest.mark.parametrize(
    "max_loras, max_cpu_loras, max_rank, match",
    [(0, None, 16, "max_loras"), (2, 1, 16, "max_cpu_loras"), (1, None, 0, "max_lora_rank")],
)
def test_bad_limits(max_loras, max_cpu_loras, max_rank, match):
    with pytest.raises(ValueError, match=match):
        LoRAManager(max_loras, max_cpu_loras, max_rank, None)


def test_max_cpu_loras_defaults_to_max_loras():
    assert LoRAManager(3, None, 16, None).max_cpu_loras == 3
