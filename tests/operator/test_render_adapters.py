"""Rendering LoRA: the engine flags of both kinds, the runtime-update env, the adapter list
ConfigMap and the wrapper that reads it, volumes of PVC adapters, fetch Jobs of Hugging Face
adapters, and a pod template that adding or removing an adapter leaves exactly as it was."""

from __future__ import annotations

import copy
import subprocess

import pytest

from kvmesh.operator import adapters as lora
from kvmesh.operator import render
from kvmesh.operator import spec as specs
from tests.operator.test_render import MD

LOCAL = {"name": "sql", "source": {"path": "/srv/adapters/sql"}}


def spec_of(**kw):
    return specs.apply_defaults({"model": {"builtin": "smollm2-135m-instruct"}, **kw})


def child(children, kind, name=None):
    return next(
        c for c in children if c["kind"] == kind and (name is None or c["metadata"]["name"] == name)
    )


def engine_container(spec):
    dep = render.render_engine_deployment(MD, spec, render.Images())
    return dep["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("kind", ["kvmesh", "vllm"])
def test_both_engine_kinds_get_the_lora_flags_and_the_runtime_update_env(kind):
    spec = spec_of(
        engine={"kind": kind},
        lora={"maxLoras": 3, "maxCpuLoras": 6, "maxRank": 64},
        adapters=[LOCAL],
    )
    engine = engine_container(spec)
    cmd = engine["command"]
    assert cmd[:4] == ["sh", "-c", lora.WRAPPER, "engine"]
    argv = cmd[4:]
    assert argv[:2] == (["vllm", "serve"] if kind == "vllm" else ["kvmesh", "serve"])
    i = argv.index("--enable-lora")
    assert argv[i : i + 7] == [
        "--enable-lora",
        "--max-loras",
        "3",
        "--max-cpu-loras",
        "6",
        "--max-lora-rank",
        "64",
    ]
    assert "--lora-modules" not in argv  # the list is the ConfigMap's, read at start
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in engine["env"]
    assert {"name": "adapters", "mountPath": "/etc/kvmesh/adapters", "readOnly": True} in engine[
        "volumeMounts"
    ]


def test_without_lora_nothing_changes():
    spec = spec_of()
    children = render.render_children(MD, spec)
    assert not [c for c in children if c["kind"] == "ConfigMap"]
    engine = engine_container(spec)
    assert engine["command"][:2] == ["kvmesh", "serve"]
    assert "--enable-lora" not in engine["command"]
    assert all(e["name"] != "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for e in engine["env"])


def test_lora_with_no_adapter_yet_has_an_empty_list():
    spec = spec_of(lora={})
    config = child(render.render_children(MD, spec), "ConfigMap")
    assert config["metadata"]["name"] == "demo-adapters"
    assert config["data"] == {"lora-modules": ""}
    cmd = engine_container(spec)["command"][4:]
    assert cmd[cmd.index("--max-loras") + 1] == "1"
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert "--max-cpu-loras" not in cmd


def test_adding_or_removing_an_adapter_changes_the_configmap_not_the_pod_template():
    before = spec_of(lora={"maxLoras": 2}, adapters=[LOCAL])
    after = copy.deepcopy(before)
    after["adapters"] += [
        {"name": "chat", "source": {"path": "/srv/adapters/chat"}},
        {"name": "old", "source": {"path": "/srv/adapters/old"}},
    ]
    removed = copy.deepcopy(after)
    removed["adapters"] = removed["adapters"][1:]
    deps = [
        render.render_engine_deployment(MD, s, render.Images(), "cred")
        for s in (before, after, removed)
    ]
    assert deps[0]["spec"]["template"] == deps[1]["spec"]["template"]
    assert deps[0]["spec"]["template"] == deps[2]["spec"]["template"]
    configs = [child(render.render_children(MD, s), "ConfigMap")["data"] for s in (before, after)]
    assert configs[0] != configs[1]
    assert configs[1]["lora-modules"] == (
        "sql=/srv/adapters/sql\nchat=/srv/adapters/chat\nold=/srv/adapters/old\n"
    )


def test_the_alias_lora_modules_is_an_adapter_list_for_both_kinds():
    for kind in ("kvmesh", "vllm"):
        spec = spec_of(engine={"kind": kind, "loraModules": [{"name": "a", "path": "/p/a"}]})
        assert specs.validate("demo", spec) == []
        assert [(a.name, a.path) for a in lora.adapters(spec)] == [("a", "/p/a")]
        assert child(render.render_children(MD, spec), "ConfigMap")["data"] == {
            "lora-modules": "a=/p/a\n"
        }


def run_wrapper(tmp_path, listing: str | None, argv: list[str]) -> list[str]:
    """Run the wrapper with the list at a temporary path; the argv it would exec."""
    script = lora.WRAPPER.replace(lora.CONFIG_DIR, str(tmp_path)).replace(
        'exec "$@"', 'printf "%s\\n" "$@"'
    )
    if listing is not None:
        (tmp_path / lora.CONFIG_KEY).write_text(listing)
    out = subprocess.run(
        ["sh", "-c", script, "engine", *argv], capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_the_wrapper_appends_one_lora_modules_flag_with_every_adapter_there(tmp_path):
    there = tmp_path / "sql"
    there.mkdir()
    listing = f"sql={there}\nmissing={tmp_path / 'not-fetched-yet'}\n\nhf=org/repo\n"
    argv = run_wrapper(tmp_path, listing, ["vllm", "serve", "m", "--max-loras", "2"])
    assert argv == [
        "vllm",
        "serve",
        "m",
        "--max-loras",
        "2",
        "--lora-modules",
        f"sql={there}",
        "hf=org/repo",
    ]


def test_the_wrapper_waits_for_a_hugging_face_fetch_to_finish(tmp_path):
    fetched = lora.HF_DIR + "/0123456789"
    listing = f"hf={fetched}\n"
    script = lora.WRAPPER.replace(lora.HF_DIR, str(tmp_path / "hf"))
    (tmp_path / "hf" / "0123456789").mkdir(parents=True)  # a download under way: no marker
    (tmp_path / lora.CONFIG_KEY).write_text(listing.replace(lora.HF_DIR, str(tmp_path / "hf")))

    def argv() -> list[str]:
        body = script.replace(lora.CONFIG_DIR, str(tmp_path)).replace(
            'exec "$@"', 'printf "%s\\n" "$@"'
        )
        out = subprocess.run(["sh", "-c", body, "engine", "e"], capture_output=True, text=True)
        return out.stdout.splitlines()

    assert argv() == ["e"]
    (tmp_path / "hf" / "0123456789" / lora.READY_MARKER).write_text("ready")
    assert argv() == ["e", "--lora-modules", f"hf={tmp_path / 'hf' / '0123456789'}"]


def test_the_wrapper_without_a_list_runs_the_engine_as_it_is(tmp_path):
    assert run_wrapper(tmp_path, None, ["kvmesh", "serve", "--port", "8000"]) == [
        "kvmesh",
        "serve",
        "--port",
        "8000",
    ]
    assert run_wrapper(tmp_path, "", ["kvmesh", "serve"]) == ["kvmesh", "serve"]


def test_pvc_adapters_mount_their_claims_read_only():
    spec = spec_of(
        model={"pvc": {"claimName": "weights", "path": "m"}},
        adapters=[
            {"name": "a", "source": {"pvc": {"claimName": "weights", "path": "lora/a"}}},
            {"name": "b", "source": {"pvc": {"claimName": "tuned", "path": "b"}}},
            {"name": "c", "source": {"pvc": {"claimName": "tuned", "path": "c"}}},
        ],
    )
    assert [a.path for a in lora.adapters(spec)] == [
        "/models/lora/a",
        "/adapters/tuned/b",
        "/adapters/tuned/c",
    ]
    pod = render.render_engine_deployment(MD, spec, render.Images())["spec"]["template"]["spec"]
    claims = [v for v in pod["volumes"] if v["name"].startswith("adapters-")]
    assert claims == [
        {
            "name": lora.claim_volume_name("tuned"),
            "persistentVolumeClaim": {"claimName": "tuned", "readOnly": True},
        }
    ]
    mount = {
        "name": lora.claim_volume_name("tuned"),
        "mountPath": "/adapters/tuned",
        "readOnly": True,
    }
    assert mount in pod["containers"][0]["volumeMounts"]


def test_hugging_face_adapters_are_fetched_into_the_shared_cache():
    spec = specs.apply_defaults(
        {
            "model": {"huggingFace": {"repoId": "o/m", "sharedCache": {"enabled": True}}},
            "adapters": [
                {
                    "name": "sql",
                    "source": {
                        "huggingFace": {"repoId": "o/sql", "tokenSecretRef": {"name": "hf"}}
                    },
                }
            ],
        }
    )
    (adapter,) = lora.adapters(spec)
    assert adapter.path.startswith("/models/kvmesh-adapters/")
    jobs = [c for c in render.render_children(MD, spec) if c["kind"] == "Job"]
    (fetch,) = [j for j in jobs if render.LABEL_ADAPTER_DIR in j["metadata"]["labels"]]
    assert fetch["metadata"]["labels"][render.LABEL_ADAPTER_DIR] == adapter.path.rsplit("/", 1)[1]
    assert fetch["metadata"]["name"].startswith("demo-adapter-")
    pod = fetch["spec"]["template"]["spec"]
    script = pod["containers"][0]["command"][2]
    assert "repo_id='o/sql'" in script and f"local_dir={adapter.path!r}" in script
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "demo-model-cache"
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}},
    } in (pod["containers"][0]["env"])
    # Another adapter is another Job; the model's own fetch Job is untouched.
    assert len(jobs) == 2


def test_with_lora_the_operator_reaches_the_engines_api():
    rules = render.render_network_policy(MD, spec_of(lora={}))["spec"]["ingress"]
    api = rules[0]
    assert {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": render.OPERATOR_POD_LABELS},
    } in (api["from"])
    plain = render.render_network_policy(MD, spec_of())["spec"]["ingress"][0]
    assert plain["from"] == [
        {"podSelector": {"matchLabels": render.selector("demo", render.ROUTER)}}
    ]


@pytest.mark.parametrize("lora_on", [False, True])
def test_a_kvmesh_sidecar_gets_the_engine_key_with_lora_to_read_the_adapters(lora_on):
    """The sidecar learns the engine's adapters from its /v1/models, behind the engine's key."""
    spec = spec_of(lora={}) if lora_on else spec_of()
    dep = render.render_engine_deployment(MD, spec, render.Images())
    sidecar = dep["spec"]["template"]["spec"]["containers"][1]
    names = [e["name"] for e in sidecar["env"]]
    assert ("KVMESH_ENGINE_API_KEY" in names) == lora_on
