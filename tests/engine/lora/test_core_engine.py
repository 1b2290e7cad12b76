"""EngineCore with adapters: add/remove/list, requests by adapter name, the per-step limit, cache
keys and KV events, reloads and unloads while requests run, and the LLM API's lora_request."""

from __future__ import annotations

import shutil

import pytest

from kvmesh.common.kv_events import BlockStored
from kvmesh.common.lora import adapter_digest
from kvmesh.engine import LLM, SamplingParams
from kvmesh.engine.core_messages import AddRequest
from kvmesh.engine.core_proc import CoreLoop
from kvmesh.engine.lora.request import LoRAError, LoRARequest
from tests.engine.conftest import random_prompts
from tests.engine.lora.reference import peft_greedy

MAX_NEW = 6


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def make_llm(base_dir, adapter_dirs=None, **kw) -> LLM:
    modules = [
        LoRARequest(name, i + 1, path)
        for i, (name, path) in enumerate(sorted(adapter_dirs.items()))
    ]
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("max_cpu_loras", 4)
    return LLM(base_dir, dtype="float32", enable_lora=True, lora_modules=modules, **kw)


def run(core, rid, prompt, lora_name=None, n=MAX_NEW):
    """Add one request and step until it ends: its tokens and request object."""
    request = core.add_request(rid, prompt, greedy(n), lora_name=lora_name)
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens, request


def test_modules_load_at_start_and_list_as_the_interface_says(lora_base_dir, lora_adapter_dirs):
    core = make_llm(lora_base_dir, lora_adapter_dirs).engine.core
    assert core.list_loras() == [
        {
            "name": name,
            "id": i + 1,
            "path": path,
            "digest": adapter_digest(path),
            "rank": {"attn": 4, "mixed": 2, "mlp": 8}[name],
            "base_model_name": None,
        }
        for i, (name, path) in enumerate(sorted(lora_adapter_dirs.items()))
    ]
    assert core.remove_lora("mlp") is True
    assert core.remove_lora("mlp") is False
    entry = core.add_lora(LoRARequest("again", 0, lora_adapter_dirs["mlp"]))
    assert (entry["name"], entry["id"], entry["rank"]) == ("again", 3, 8)  # the first free id
    assert [e["name"] for e in core.list_loras()] == ["attn", "mixed", "again"]


def test_unknown_adapters_and_engines_without_lora_refuse(lora_base_dir, lora_adapter_dirs):
    core = make_llm(lora_base_dir, lora_adapter_dirs).engine.core
    with pytest.raises(LoRAError, match="'nope' is not loaded"):
        core.add_request("r", [1, 2, 3], greedy(), lora_name="nope")
    assert not core.has_unfinished_requests()
    small = make_llm(lora_base_dir, {}, max_lora_rank=4).engine.core
    with pytest.raises(LoRAError, match="big"):
        small.add_lora(LoRARequest("big", 0, lora_adapter_dirs["mlp"]))  # rank 8
    assert small.list_loras() == []
    plain = LLM(lora_base_dir, num_kv_blocks=64)
    with pytest.raises(LoRAError, match="not enabled"):
        plain.engine.core.add_request("r", [1, 2, 3], greedy(), lora_name="attn")
    with pytest.raises(LoRAError, match="not enabled"):
        plain.generate([[1, 2, 3]], greedy(), lora_request=LoRARequest("a", 1, "/x"))
    assert plain.engine.core.list_loras() == [] and plain.engine.core.remove_lora("a") is False
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(lora_base_dir, lora_modules=[LoRARequest("a", 1, lora_adapter_dirs["attn"])])


def test_max_loras_one_runs_one_adapter_per_step_with_base_alongside(
    lora_base_dir, lora_adapter_dirs
):
    llm = make_llm(lora_base_dir, lora_adapter_dirs, max_loras=1)
    core = llm.engine.core
    schedule = core.scheduler.schedule
    steps = []

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append((sorted(r.request_id for r in out.requests), core.stats()))
        return out

    core.scheduler.schedule = recording
    prompts = random_prompts(4, 5, 5, seed=1)
    for rid, prompt, name in zip("abcd", prompts, ("attn", "mlp", None, "mixed")):
        core.add_request(rid, prompt, greedy(3), lora_name=name)
    while core.has_unfinished_requests():
        core.step()
    # Each adapter runs alone (3 steps: prefill, 2 decodes); the base request rides along.
    assert [ids for ids, _ in steps] == [["a", "c"], ["a", "c"], ["a", "c"]] + [["b"]] * 3 + [
        ["d"]
    ] * 3
    first = steps[0][1]  # stats after the first schedule
    assert first.running_lora_adapters == ["attn"]
    assert first.waiting_lora_adapters == ["mlp", "mixed"]
    assert first.max_loras == 1


def test_events_carry_the_adapter_and_keys_never_cross_adapters(lora_base_dir, lora_adapter_dirs):
    core = make_llm(lora_base_dir, lora_adapter_dirs, enable_kv_events=True).engine.core
    prompt = random_prompts(1, 40, 40, seed=2)[0]  # 2 full blocks of 16 can be reused
    run(core, "a1", prompt, "attn")
    stored = [e for e in core.take_kv_events() if isinstance(e, BlockStored)]
    assert {(e.lora_id, e.lora_name) for e in stored} == {(1, "attn")}
    assert sum(len(e.block_hashes) for e in stored) == (40 + MAX_NEW - 1) // 16
    for rid, name in (("base", None), ("m1", "mlp"), ("x1", "mixed")):
        _, request = run(core, rid, prompt, name)
        assert request.num_cached_tokens == 0, name
    stored = [e for e in core.take_kv_events() if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.lora_name) for e in stored] == [(None, None), (3, "mlp"), (2, "mixed")]
    _, again = run(core, "a2", prompt, "attn")
    assert again.num_cached_tokens == 32


def test_same_name_reload_with_new_weights_never_hits_the_old_blocks(
    lora_base_dir, lora_adapter_dirs, tmp_path
):
    core = make_llm(lora_base_dir, {"attn": lora_adapter_dirs["attn"]}).engine.core
    path = tmp_path / "served"
    shutil.copytree(lora_adapter_dirs["attn"], path)
    core.add_lora(LoRARequest("served", 0, str(path)))
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    run(core, "old", prompt, "served")
    _, hit = run(core, "old-again", prompt, "served")
    assert hit.num_cached_tokens == 32
    shutil.rmtree(path)
    shutil.copytree(lora_adapter_dirs["mlp"], path)  # new files under the same name and path
    old_digest = core.list_loras()[1]["digest"]
    entry = core.add_lora(LoRARequest("served", 0, str(path)))
    assert entry["digest"] == adapter_digest(path) != old_digest
    hits = core.stats().prefix_cache_hits
    tokens, fresh = run(core, "new", prompt, "served")
    assert fresh.num_cached_tokens == 0
    assert core.stats().prefix_cache_hits == hits  # not one stale block
    assert tokens == peft_greedy(lora_base_dir, lora_adapter_dirs, "mlp", prompt, MAX_NEW)


def _start(core, rid, prompt, name, n):
    core.add_request(rid, prompt, greedy(n), lora_name=name)
    tokens = []
    for _ in range(3):  # prefill and two decodes
        tokens += [t for o in core.step() if o.request_id == rid for t in o.new_token_ids]
    return tokens


def _finish(core, rid, tokens):
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() if o.request_id == rid for t in o.new_token_ids]
    return tokens


def test_unload_while_running_finishes_with_its_adapter(lora_base_dir, lora_adapter_dirs):
    core = make_llm(lora_base_dir, lora_adapter_dirs).engine.core
    prompt = random_prompts(1, 12, 12, seed=4)[0]
    tokens = _start(core, "r", prompt, "mlp", 12)
    adapter = core.lora_adapter("mlp")
    assert core.loras.refcount(adapter) == 1
    assert core.remove_lora("mlp")
    with pytest.raises(LoRAError):
        core.add_request("late", prompt, greedy(), lora_name="mlp")
    tokens = _finish(core, "r", tokens)
    assert tokens == peft_greedy(lora_base_dir, lora_adapter_dirs, "mlp", prompt, 12)
    assert core.loras.refcount(adapter) == 0


def test_reload_while_running_keeps_the_running_request_on_the_old_adapter(
    lora_base_dir, lora_adapter_dirs, tmp_path
):
    core = make_llm(lora_base_dir, {}).engine.core
    path = tmp_path / "served"
    shutil.copytree(lora_adapter_dirs["attn"], path)
    core.add_lora(LoRARequest("served", 0, str(path)))
    prompt = random_prompts(1, 12, 12, seed=5)[0]
    tokens = _start(core, "r", prompt, "served", 12)
    shutil.rmtree(path)
    shutil.copytree(lora_adapter_dirs["mixed"], path)
    core.add_lora(LoRARequest("served", 0, str(path)))
    core.add_request("new", prompt, greedy(12), lora_name="served")
    new_tokens = []
    while core.has_unfinished_requests():
        for o in core.step():
            (tokens if o.request_id == "r" else new_tokens).extend(o.new_token_ids)
    assert tokens == peft_greedy(lora_base_dir, lora_adapter_dirs, "attn", prompt, 12)
    assert new_tokens == peft_greedy(lora_base_dir, lora_adapter_dirs, "mixed", prompt, 12)


def test_core_loop_passes_the_adapter_name(lora_base_dir, lora_adapter_dirs):
    core = make_llm(lora_base_dir, lora_adapter_dirs).engine.core
    loop = CoreLoop(core)
    assert loop.add(AddRequest("r", [1, 2, 3], greedy(), lora_name="attn")) is None
    assert core.scheduler.requests["r"].lora.name == "attn"
    assert isinstance(loop.add(AddRequest("s", [1, 2, 3], greedy(), lora_name="x")), LoRAError)


def test_generate_loads_adapters_on_first_use(lora_base_dir, lora_adapter_dirs):
    llm = make_llm(lora_base_dir, {}, max_loras=2, max_cpu_loras=2)
    prompts = random_prompts(3, 6, 10, seed=6)
    attn = LoRARequest("attn", 5, lora_adapter_dirs["attn"])
    outs = llm.generate(prompts, greedy(), lora_request=attn)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == peft_greedy(
            lora_base_dir, lora_adapter_dirs, "attn", prompt, MAX_NEW
        )
    assert [(e["name"], e["id"]) for e in llm.engine.core.list_loras()] == [("attn", 5)]
    mixed = LoRARequest("mixed", 6, lora_adapter_dirs["mixed"])
    with pytest.raises(ValueError, match="3 lora requests for 2 prompts"):
        llm.generate(prompts[:2], greedy(), lora_request=[attn, None, mixed])
    mlp = LoRARequest("mlp", 7, lora_adapter_dirs["mlp"])
    with pytest.raises(ValueError, match="max_cpu_loras is 2"):
        llm.generate(prompts, greedy(), lora_request=[attn, mixed, mlp])
    outs = llm.generate(prompts, greedy(), lora_request=[mixed, None, attn])
    for prompt, name, out in zip(prompts, ("mixed", None, "attn"), outs):
        expected = peft_greedy(lora_base_dir, lora_adapter_dirs, name, prompt, MAX_NEW)
        assert list(out.outputs[0].token_ids) == expected, name
    assert sorted(e["name"] for e in llm.engine.core.list_loras()) == ["attn", "mixed"]
