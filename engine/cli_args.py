"""Engine flags shared by every command that runs an engine (`serve`, `generate`).

Names and defaults as in docs/cli.md; the operator renders pods with these flags.
"""

from __future__ import annotations

import argparse

from kvmesh.common.block_keys import DEFAULT_BLOCK_SIZE
from kvmesh.common.model_lookup import DEFAULT_MODEL
from kvmesh.engine.prefill_order import DEFAULT_MAX_SKIPS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate` and `serve` (names as in docs/cli.md)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="built-in model name or HF directory")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` clients ask for; also the block-key model identity (default: the model name)",
    )
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks (default: sized from `--kv-cache-memory`)",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache size, e.g. 4GiB (default: 4GiB on the CPU; on a GPU, what "
        "--gpu-memory-utilization leaves after the weights and a profiling step)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per engine step (default: 2048; 512 for `serve` on the CPU, where a "
        "step's time grows with its tokens)",
    )
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's)",
    )
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--scheduling-policy",
        default=None,
        choices=["fcfs", "priority", "sjf"],
        help="which waiting request the token budget goes to first: fcfs (arrival), priority "
        "(the request's `priority`, lower first, then arrival; as vLLM's) or sjf (shortest "
        "prompt after prefix-cache hits first, aged by --max-prefill-skips); default: sjf for "
        "`serve`, fcfs for `generate`",
    )
    g.add_argument(
        "--max-prefill-skips",
        type=_non_negative_int,
        default=DEFAULT_MAX_SKIPS,
        metavar="N",
        help="sjf: a prompt passed over by N later arrivals goes first (0: fcfs)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for parameters a request leaves out: auto (the model's "
        "generation_config.json), vllm (OpenAI's) or a folder holding a generation_config.json",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "triton"],
        help="attention and fused-op kernels: auto (triton on CUDA, the compiled kernels on "
        "the CPU), or force one (triton on the CPU runs under Triton's interpreter)",
    )
    g.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    g.add_argument(
        "--compilation-config",
        type=_compilation_config,
        default=None,
        metavar="JSON",
        help='which CUDA graphs, as vLLM\'s: \'{"cudagraph_mode": "FULL_AND_PIECEWISE"}\' (the default: '
        "full graphs for decode-only steps, piecewise graphs with eager attention for the others "
        "up to max_cudagraph_capture_size tokens), FULL_DECODE_ONLY, PIECEWISE or NONE; "
        "cudagraph_capture_sizes lists the piecewise token counts",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory the engine may use; the KV cache gets what the "
        "weights and a profiling step leave of it",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and prepare the next step while the current one runs (as vLLM's); "
        "default: on for CUDA devices, off on the CPU",
    )
    g.add_argument(
        "--adapt-threads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on the CPU, run fewer torch threads while other processes take CPU time on the "
        "engine's CPUs, and all of them when they leave; default: on unless the thread count "
        "is pinned (--omp-threads, OMP_NUM_THREADS)",
    )
    g.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GiB",
        help="host tier: blocks evicted from the KV cache are copied to this much host memory "
        "and loaded back on a prefix hit (off by default)",
    )
    g.add_argument(
        "--kv-offloading-backend",
        default="native",
        help="the host tier's implementation; only `native` (the engine's own) is accepted",
    )
    g.add_argument(
        "--kv-shared-dir",
        default=None,
        metavar="PATH",
        help="shared tier: a directory every replica mounts, one file per KV block, written "
        "behind the requests and read on a prefix hit (off by default)",
    )
    g.add_argument(
        "--kv-shared-size",
        type=float,
        default=10.0,
        metavar="GiB",
        help="the most the shared tier's directory holds (least recently used entries go first)",
    )
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (off by default)',
    )
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="no drafts in a step with N or more running requests (overrides the config's "
        "disable_by_batch_size; default 16)",
    )


def _speculative_config(text: str):
    from kvmesh.engine.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _compilation_config(text: str):
    from kvmesh.engine.compilation_config import CompilationConfig

    try:
        return CompilationConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _with_batch_limit(args: argparse.Namespace):
    spec, limit = (
        getattr(args, "speculative_config", None),
        getattr(args, "speculative_disable_by_batch_size", None),
    )
    if limit is None:
        return spec
    from dataclasses import replace

    from kvmesh.engine.spec_decode.config import SpeculativeConfigError

    if spec is None:
        raise SpeculativeConfigError(
            "--speculative-disable-by-batch-size", "needs --speculative-config"
        )
    return replace(spec, disable_by_batch_size=limit)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def engine_args_from(args: argparse.Namespace, server: bool = False, **overrides):
    """EngineArgs from the parsed flags; `server`: the defaults of `serve` (the token budget, and
    sjf: a server's clients wait for first tokens; an offline batch only for the whole)."""
    from kvmesh.engine.config import EngineArgs, default_token_budget

    budget = args.max_num_batched_tokens
    if budget is None:
        budget = default_token_budget(args.device, server)
    return EngineArgs(
        model=args.model,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=budget,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=getattr(args, "scheduling_policy", None) or ("sjf" if server else "fcfs"),
        max_prefill_skips=getattr(args, "max_prefill_skips", DEFAULT_MAX_SKIPS),
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        generation_config=args.generation_config,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        compilation_config=getattr(args, "compilation_config", None),
        gpu_memory_utilization=args.gpu_memory_utilization,
        speculative_config=_with_batch_limit(args),
        async_scheduling=getattr(args, "async_scheduling", None),
        adapt_threads=getattr(args, "adapt_threads", None),
        kv_offloading_size=getattr(args, "kv_offloading_size", None),
        kv_offloading_backend=getattr(args, "kv_offloading_backend", "native"),
        kv_shared_dir=getattr(args, "kv_shared_dir", None),
        kv_shared_size=getattr(args, "kv_shared_size", 10.0),
        **overrides,
    )
