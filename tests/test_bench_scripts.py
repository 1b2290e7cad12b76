"""The benchmark scripts are not run by the suite (they take minutes, or a GPU), so a moved
function breaks them silently until someone runs one on a rare GPU lease. This checks what
can be checked cheaply: every kvmesh name a script imports exists, and every script or test
a shell driver calls is there."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def kvmesh_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for `from kvmesh... import name` and (module, None) for `import kvmesh...`,
    wherever they sit in the script (most import inside functions)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "kvmesh"
        ):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [
                (alias.name, None) for alias in node.names if alias.name.split(".")[0] == "kvmesh"
            ]
    return found


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 5 and all(kvmesh_imports(p) is not None for p in SCRIPTS)
    assert any(kvmesh_imports(p) for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_kvmesh_import_of_a_bench_script_resolves(script):
    missing = []
    for module, name in kvmesh_imports(script):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{script.name} imports names that do not exist: {missing}"


@pytest.mark.parametrize("driver", sorted(BENCH.glob("*.sh")), ids=lambda p: p.name)
def test_every_file_a_shell_driver_runs_exists(driver):
    root = BENCH.parent
    referenced = set(re.findall(r"\b((?:bench|tests)/[\w/]+\.py)\b", driver.read_text()))
    assert all((root / r).is_file() for r in referenced), (
        f"{driver.name} runs files that are not there: {[r for r in referenced if not (root / r).is_file()]}"
    )


@pytest.fixture
def serve(monkeypatch):
    """bench/serve.py as the module `serve` (bench/ is not a package), imported by name from a
    sys.path entry undone after the test: the offline engine's spawned process imports its
    worker the same way (the child takes this sys.path), as the main script when serve.py runs."""
    monkeypatch.syspath_prepend(str(BENCH))
    try:
        yield importlib.import_module("serve")
    finally:
        sys.modules.pop("serve", None)


def test_a_paused_server_and_its_children_take_no_cpu_until_resumed(tmp_path, serve):
    """bench/serve.py's comparison pauses the server it does not measure (an idle vLLM polls and
    stalls the measured engine's OpenMP threads): the whole process group stops, the engine core
    child too, and runs on when resumed; stop() works on a paused server."""
    counter = tmp_path / "ticks"
    child = f"import time\nwhile True:\n    open({str(counter)!r}, 'a').write('.')\n    time.sleep(0.01)\n"
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(3600)\n"
    srv = object.__new__(serve.LocalServer)  # the process handling only, not a kvmesh server
    srv.proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    srv.log = open(tmp_path / "log", "w")
    try:
        deadline = time.monotonic() + 30
        while not counter.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.pause()
        time.sleep(0.2)  # a tick already under way lands
        paused_at = counter.stat().st_size
        time.sleep(0.5)
        assert counter.stat().st_size == paused_at, "the grandchild ran on while paused"
        srv.resume()
        time.sleep(0.5)
        assert counter.stat().st_size > paused_at + 5, "the grandchild did not run on when resumed"
        srv.pause()
    finally:
        srv.stop()  # resumes first: a stopped process would hold the SIGTERM
        with contextlib.suppress(
            ProcessLookupError
        ):  # the grandchild, which SIGTERM to the parent leaves
            os.killpg(srv.proc.pid, signal.SIGKILL)
    assert srv.proc.returncode is not None


def test_the_offline_engine_is_one_process_for_every_run_and_survives_a_failed_one(tmp_path, serve):
    """The comparison's engine alone lives as long as the servers (a fresh process per run frees
    gigabytes at each exit, which this VM's host reclaims by stealing CPU from the next run): one
    process runs every workload, reports each run's tokens, answers a failed run with its error
    and runs on; paused, it takes no CPU; stop() works on a paused engine."""
    import psutil

    from tests.tiny_models import build_tiny_model

    model = str(build_tiny_model(tmp_path / "tiny", "tiny-llama"))
    reqs = [serve.Req(list(range(10, 10 + n)), m) for n, m in ((5, 3), (17, 4), (9, 2))]
    with serve.OfflineEngine(model, "float32", 64) as engine:
        pid = engine.proc.pid
        seconds, prompt_tokens, output_tokens = engine.run(reqs, 2)
        assert (prompt_tokens, output_tokens) == (31, 9) and seconds > 0
        with pytest.raises(RuntimeError, match="offline engine: .*"):
            engine.run([serve.Req([10**9], 2)], 1)  # a token id outside the vocabulary
        assert engine.run(reqs[:1], 1)[1:] == (5, 3) and engine.proc.pid == pid
        proc = psutil.Process(pid)
        engine.pause()
        assert _status_becomes(proc, psutil.STATUS_STOPPED)
        engine.resume()
        assert _status_becomes(proc, psutil.STATUS_SLEEPING)  # waiting for the next run
        engine.pause()
    assert not engine.proc.is_alive()


def _status_becomes(proc, status: str, timeout: float = 5.0) -> bool:
    """Signals land asynchronously: poll the process's state for a while."""
    deadline = time.monotonic() + timeout
    while proc.status() != status:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def bench_module(monkeypatch):
    """A bench/ script as a module, imported by name (bench/ is not a package)."""
    monkeypatch.syspath_prepend(str(BENCH))
    loaded = []

    def load(name: str):
        loaded.append(name)
        return importlib.import_module(name)

    yield load
    for name in loaded + ["serve"]:
        sys.modules.pop(name, None)


def test_gpu_serve_pairs_each_concurrency_with_its_request_count(bench_module):
    gpu_serve = bench_module("gpu_serve")
    assert gpu_serve.parse_levels("1, 16,256", "8,64,512") == [(1, 8), (16, 64), (256, 512)]
    with pytest.raises(ValueError, match="3 levels but --requests 2"):
        gpu_serve.parse_levels("1,16,64", "8,64")
    with pytest.raises(ValueError, match="concurrency 64 with 32 requests"):
        gpu_serve.parse_levels("64", "32")


def test_gpu_figures_reads_the_logs_of_the_steps_that_print_their_figures(bench_module, tmp_path):
    figures = bench_module("gpu_figures")
    assert figures.kernel_counts("....\n15 passed, 2 skipped, 1 warning in 31.2s\n") == {
        "passed": 15,
        "skipped": 2,
    }
    assert figures.kernel_counts("E   ImportError\n1 error in 0.5s") == {"error": 1}
    offline = (
        "system         time s  output tok/s  total tok/s\n"
        "kvmesh          2.1        3901.2      21000.5\n"
        "hf-static      10.4         790.0       4250.0\n"
        "ratio kvmesh / hf-static: output 4.94x, total 4.94x (target >= 3.0x total)\n"
    )
    assert figures.offline_rates(offline) == {
        "kvmesh": {"seconds": 2.1, "output_tok_s": 3901.2, "total_tok_s": 21000.5},
        "hf-static": {"seconds": 10.4, "output_tok_s": 790.0, "total_tok_s": 4250.0},
        "ratio_total": 4.94,
    }
    (tmp_path / "serve.json").write_text('{"levels": {"256": {"total_tok_s": 9.5}}}')
    (tmp_path / "kernels.log").write_text("15 passed in 3s")
    (tmp_path / "profile.json").write_text("{not json")
    out = figures.collect(
        tmp_path,
        ["kernels PASS 30", "serve PASS 120", "profile FAIL(timeout) 80", "offline SKIP 0"],
    )
    steps = out["steps"]
    assert steps["kernels"] == {"result": "PASS", "seconds": 30, "figures": {"passed": 15}}
    assert steps["serve"]["figures"]["levels"]["256"]["total_tok_s"] == 9.5
    assert steps["profile"]["result"] == "FAIL(timeout)" and "figures_error" in steps["profile"]
    assert steps["offline"] == {"result": "SKIP", "seconds": 0, "figures": {}}


def test_gpu_profile_counts_overlapping_device_intervals_once(bench_module):
    from types import SimpleNamespace

    gpu_profile = bench_module("gpu_profile")
    cuda, cpu = "cuda", "cpu"
    DeviceType = SimpleNamespace(CUDA=cuda)

    def ev(name, device, start, end):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
        )

    prof = SimpleNamespace(
        events=lambda: [
            ev("gemm", cuda, 0, 1000),
            ev("copy", cuda, 500, 1500),  # overlapping: 1.5 ms together
            ev("norm", cuda, 3000, 3500),
            ev("empty", cuda, 4000, 4000),  # apart: 0.5 ms; empty: nothing
            ev("cudaLaunchKernel", cpu, 0, 10),
            ev("cudaGraphLaunch", cpu, 20, 30),
            ev("aten::mm", cpu, 0, 50),
        ]
    )
    assert gpu_profile.busy_ms(prof, DeviceType) == (2.0, 2)


def test_gpu_check_pins_one_wheel_per_package_and_the_random_1b_shape_is_1_07b():
    text = (BENCH / "gpu_check.sh").read_text()
    pins = re.search(r"WHEELS=\(([^)]*)\)", text).group(1).split()
    names = [p.split("==")[0] for p in pins]
    assert all("==" in p for p in pins) and len(set(names)) == len(names)
    # the engine core's messages and the server's framework: what a bare GPU image lacks
    assert {
        "pyzmq",
        "msgspec",
        "fastapi",
        "uvicorn",
        "pydantic",
        "starlette",
        "opentelemetry_api",
    } <= set(names)
    assert 1.06e9 < preset_parameters("llama-1.07b") < 1.08e9


def test_the_random_8b_shape_is_llama3_8b_layers():
    assert 7.3e9 < preset_parameters("llama-8b") < 7.5e9


def preset_parameters(name: str, vocab: int = 49152) -> int:
    """Parameters of a bench/random_checkpoint.py preset over the built-in model's vocabulary."""
    sys.path.insert(0, str(BENCH))
    try:
        preset = importlib.import_module("random_checkpoint").PRESETS[name]
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("random_checkpoint", None)
    h, i, layers = preset["hidden_size"], preset["intermediate_size"], preset["num_hidden_layers"]
    kv = preset["num_key_value_heads"] * preset["head_dim"]
    heads = 1 if preset["tie_word_embeddings"] else 2
    return heads * vocab * h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h


def test_gpu_decode_sorts_kernels_by_kind_per_step(bench_module, capsys):
    gpu_decode = bench_module("gpu_decode")
    rows = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 800.0, 8),
        ("_decode_kernel", 100.0, 4),
        ("_decode_reduce_kernel", 20.0, 4),
        ("_fused_add_rms_norm_kernel", 40.0, 8),
        ("_rotary_store_kernel", 30.0, 4),
        ("Memcpy HtoD (Pinned -> Device)", 10.0, 4),
        ("void at::native::argmax_kernel", 50.0, 4),
    ]
    kinds = gpu_decode.kernel_breakdown(rows, steps=4)
    assert list(kinds)[0] == "gemm" and kinds["gemm"] == (0.2, 2.0)
    assert kinds["attention"] == (0.03, 2.0)
    assert kinds["norm/rope/silu"] == (0.0175, 3.0)
    assert kinds["copy"] == (0.0025, 1.0) and kinds["other"] == (0.0125, 1.0)
    gpu_decode.print_breakdown("cuda-graphs batch 1", rows, 4, weight_bytes=int(2e9), peak=4.8e12)
    line = capsys.readouterr().out
    # 2 GB of weights in 0.2 ms of GEMMs: 10 TB/s, above the datasheet (numbers made up)
    assert "gemm 0.200 ms (76%, 2 kernels, weights at 10.00 TB/s = 208% of datasheet)" in line
    assert "0.263 ms, 9 kernels per step" in line


def test_structured_online_counts_valid_cut_invalid_and_refused_replies(
    bench_module, tmp_path, capsys
):
    """bench/structured_online.py against a scripted OpenAI-style server: per schema, the
    constrained reply is valid, refused (400), cut by max_tokens, invalid or valid; every
    unconstrained reply is fenced JSON (not a bare document). Two names for the server give the
    ratio line; --results keeps the runs and refuses a file saved with other settings."""
    import asyncio
    import json
    import threading

    from aiohttp import web

    so = bench_module("structured_online")
    constrained_replies = {  # (status, text, finish_reason) per schema
        "flat": (200, '{"name": "a", "age": 3}', "stop"),
        "nested": (400, "", None),
        "anyof_ref": (200, '{"v": "ab", "items": [', "length"),
        "order": (200, '{"order_id": 0}', "stop"),
        "event": (
            200,
            '{"title": "t", "day": "mon", "attendees": ["a", "b"], "online": true}',
            "stop",
        ),
    }
    assert set(constrained_replies) == set(so.SCHEMAS)

    async def chat(request):
        body = await request.json()
        spec = body.get("response_format")
        status, text, finish = (
            constrained_replies[spec["json_schema"]["name"]]
            if spec
            else (200, '```json\n{"name": "a"}\n```', "stop")
        )
        if status != 200:
            return web.json_response({"error": {"message": "unsupported schema"}}, status=status)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for piece, reason in ((text[:5], None), (text[5:], finish)):
            chunk = {
                "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": reason}]
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
        await resp.write(
            f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
        )
        return resp

    async def models(_):
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    results = tmp_path / "runs.json"
    url = f"http://127.0.0.1:{port}"
    try:
        args = [
            "--url",
            f"a={url}",
            "--url",
            f"b={url}/",
            "--model",
            "m",
            "--requests",
            "10",
            "--warmup",
            "1",
            "--results",
            str(results),
        ]
        assert so.main(args) == 0
        out = capsys.readouterr().out
        with pytest.raises(SystemExit):
            so.main([*args[:4], "--requests", "12", "--results", str(results)])
        assert "saved with" in capsys.readouterr().err
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    runs = json.loads(results.read_text())["runs"]
    assert set(runs) == {"a", "b"}
    c, u = runs["a"]["constrained"], runs["a"]["unconstrained"]
    assert (c["requests"], c["valid"], c["cut"], c["invalid"], c["refused"]) == (5, 2, 1, 1, 1)
    assert c["valid_share"] == 0.4 and "unsupported schema" in c["first_refusal"]
    assert (u["requests"], u["valid"], u["invalid"], u["refused"]) == (5, 0, 5, 0)
    assert runs["a"]["output_tok_s"] > 0 and c["ttft_p50_ms"] > 0
    assert "schema-valid 2/5 (40%); cut by max_tokens 1, invalid 1, refused 1" in out
    assert "ratio a/b: output tok/s" in out
    with pytest.raises(ValueError, match="NAME=http"):
        so.parse_urls(["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="given twice"):
        so.parse_urls(["a=http://x:1", "a=http://x:2"])


def test_flow_control_splits_capacity_max_min_fair_and_sizes_the_overload(bench_module):
    fc = bench_module("flow_control")
    assert fc.max_min_fair(30, {"heavy": 100, "a": 5, "b": 50}) == {
        "a": 5,
        "b": 12.5,
        "heavy": 12.5,
    }
    args = fc.parse(["--replicas", "2", "--max-num-seqs", "48"])
    p = fc.plan(args)
    assert p.capacity_rps == pytest.approx(2 * 48 / (8 * 0.4))
    assert sum(p.tenants.values()) == pytest.approx(4 * p.capacity_rps)
    assert p.tenants["heavy"] == pytest.approx(10 * p.tenants["light-1"])
    cmd = fc.up_flags(args, flow=True)
    router_args = cmd[cmd.index("--router-args") + 1]
    assert "--flow-control" in router_args and "--flow-pod-max-inflight 48" in router_args
    assert "--flow-control" not in fc.up_flags(args, flow=False)[-1]


def test_flow_control_bench_runs_at_a_tiny_size():
    """bench/flow_control.py end to end on a tiny `kvmesh up` of stub engines, both modes."""
    out = subprocess.run(
        [sys.executable, "-P", str(BENCH / "flow_control.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for line in ("== flow", "== baseline", "heavy", "light-1", "refusals by band", "targets:"):
        assert line in out.stdout, out.stdout


def test_busy_neighbours_run_during_the_pass_and_are_killed_after(serve, capsys):
    assert serve._counts("0, 1,2") == [0, 1, 2]
    with pytest.raises(argparse.ArgumentTypeError):
        serve._counts("-1")
    with serve.busy_neighbours(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)

    def run(v, k):
        return [{"vllm": [{"total_tok_s": v}], "kvmesh": [{"total_tok_s": k}]}]

    serve._print_busy_report(["random"], {0: run(300.0, 600.0), 1: run(270.0, 300.0)})
    out = capsys.readouterr().out
    assert "1.11x" in out and "50.0%" in out and "90.0%" in out


def test_vllm_client_maps_each_workload_and_reads_back_its_saved_result(bench_module):
    """--client vllm: the long workload is vLLM's random dataset with an input-only range ratio
    (1,000 +- 500 in, every output 48); a saved result with a failed request reads back as the
    summary bench/serve.py prints (TPOT per request from its gaps, every ITL, the failure)."""
    vllm_client = bench_module("vllm_client")
    serve = bench_module("serve")
    args = serve.argparse.Namespace(
        long_input_len=1000,
        long_input_spread=500,
        long_output_len=48,
        long_num_prompts=40,
        long_concurrency=20,
    )
    flags, prompts, conc = vllm_client.dataset_flags("long", args)
    assert (prompts, conc) == (40, 20)
    ratio = flags[flags.index("--random-range-ratio") + 1]
    assert serve.json.loads(ratio) == {"input": 0.5, "output": 0.0}
    assert flags[flags.index("--random-input-len") + 1] == "1000"
    with pytest.raises(ValueError):
        vllm_client.dataset_flags("nope", args)
    saved = {
        "completed": 2,
        "total_token_throughput": 900.0,
        "output_throughput": 100.0,
        "ttfts": [0.5, 0.25, 0.0],
        "input_lens": [1000, 700, 0],
        "output_lens": [3, 1, 0],
        "itls": [[0.1, 0.3], [], []],
    }
    s = vllm_client.summary(saved, 3)
    assert s["total_tok_s"] == 900.0 and s["failed"] == 1 and s["ok"] == 2
    assert s["ttft"] == [0.5, 0.25] and s["itl"] == [0.1, 0.3]
    assert s["tpot"] == [pytest.approx(0.2)]
    assert s["lens"] == [(1000, 3), (700, 1), (0, 0)]


def test_the_ceiling_counts_each_tokens_flops_once(bench_module):
    """bench/ceiling.py: SmolLM2-135M's linears are 212,336,640 FLOPs a token (30 layers of qkv
    576 -> 960, o 576 -> 576, gate/up/down 576 <-> 1,536, 2 FLOPs a multiply-add); a request's
    attention counts the keys each prefill row and each decode sees; a cached prefix costs
    nothing; the first output token's LM head runs at the prefill."""
    from types import SimpleNamespace

    ceiling = bench_module("ceiling")
    smollm2 = SimpleNamespace(
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        vocab_size=49152,
    )
    cost = ceiling.ModelCost.of(smollm2)
    assert cost.linears_per_token == 212_336_640
    assert cost.attention_per_key == 4 * 9 * 64 * 30
    assert cost.head_per_token == 2 * 49152 * 576
    unit = ceiling.ModelCost(linears_per_token=1, attention_per_key=10, head_per_token=100)
    # prompt 3 with 1 cached: prefill rows see 2 and 3 keys; output 2: one decode over 4 keys
    assert unit.request_flops(3, 1, 2) == 3 * 1 + (2 + 3 + 4) * 10 + 2 * 100
    assert unit.request_flops(3, 3, 1) == 0 + 0 + 100  # all cached: the LM head row only
    reqs = [(3, 1, 2), (3, 3, 1)]
    assert ceiling.workload_flops(unit, reqs) == 293 + 100
    # 12 tokens over 393 FLOPs at 393 FLOP/s: 12 tok/s
    assert ceiling.ceiling_tok_s(unit, reqs, 393.0) == pytest.approx(9.0)
    assert ceiling.share_beside(2, 0) == 1.0 and ceiling.share_beside(2, 1) == pytest.approx(2 / 3)
    assert ceiling.repeated_prefix_cached(6, 2, 10) == [0, 0, 10, 10, 10, 10]


def test_the_matmul_peak_is_measured_on_the_threads_asked_and_leaves_torchs_count(bench_module):
    import torch

    ceiling = bench_module("ceiling")
    before = torch.get_num_threads()
    assert ceiling.matmul_peak(threads=1, rows=64, reps=1) > 1e8  # any CPU does 0.1 GFLOP/s
    assert torch.get_num_threads() == before
    assert 1 <= ceiling.engine_cpus() <= (os.cpu_count() or 1)


def test_compare_vllm_prints_each_workloads_ceiling_against_both_servers(serve, capsys):
    """The ceiling of each pass from the prompts vLLM's run served (the prefix workload with its
    prefixes cached), as a multiple of vLLM's throughput and kvmesh's share of it; beside one
    busy process the peak is scaled to cpus / (cpus + 1)."""
    cost = serve.ceiling.ModelCost(linears_per_token=100, attention_per_key=0, head_per_token=0)
    args = argparse.Namespace(dtype="float32", prefix_rep_num_prefixes=1, prefix_rep_prefix_len=8)
    lens = [(10, 1), (10, 1)]  # 22 tokens; random: 20 prompt tokens at 100 FLOPs each

    def run(v, k):
        return {
            "vllm": [{"total_tok_s": v, "lens": lens}],
            "kvmesh": [{"total_tok_s": k, "lens": lens}],
        }

    cpus = serve.ceiling.engine_cpus()
    serve._print_ceiling(
        ["random", "prefix"],
        ["random", "prefix"],
        {0: [run(1.0, 2.0), run(1.0, 2.0)], 1: [run(1.0, 1.0), run(1.0, 1.0)]},
        2000.0,
        cost,
        args,
    )
    lines = capsys.readouterr().out.splitlines()
    row = {
        (ln.split()[0], ln.split()[1]): ln.split()
        for ln in lines
        if ln.startswith("   ") and ln.split()[1].isdigit()
    }
    # random, quiet: 22 tokens over 2,000 FLOPs at 2,000 FLOP/s = 22 tok/s: 22x vLLM, kvmesh at 9.1%
    assert row[("random", "0")][2:6] == ["22.0", "22.00x", "2.5x", "9.1%"]
    # prefix: the second prompt finds 8 of its 10 tokens cached: 22 tokens over 1,200 FLOPs
    assert row[("prefix", "0")][2] == f"{22 * 2000 / 1200:.1f}"
    # beside one busy process: cpus / (cpus + 1) of the peak; the goal there is 2x
    assert row[("random", "1")][2] == f"{22 * cpus / (cpus + 1):.1f}"
    assert row[("random", "1")][4] == "2.0x"
