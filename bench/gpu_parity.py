#!/usr/bin/env python3
"""GPU greedy parity: kvmesh (Triton backend, CUDA graphs and eager) against transformers on the
same GPU, fp32 and bf16, on the built-in model (part of bench/gpu_check.sh); async scheduling
(the CUDA default) with graphs and eager, and synchronous with graphs.

fp32 must match token for token (the kernels multiply in IEEE fp32, not TF32), also with speculative
decoding (n-gram drafts verified through the Triton backend): exit 1 if not.
bf16 is reported (prompts identical, tokens matching before the first divergence): two bf16
implementations round differently, so a late divergence on a near-tie is expected.
"""

from __future__ import annotations

import argparse
import gc
import sys


# Drafts from single-token matches too, always on: random weights rarely repeat a 2-gram.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "acceptance_threshold": 0.0, "disable_by_batch_size": None}


def hf_greedy(model_dir, dtype, prompts, max_new_tokens):
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers import GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: EOS may be generated, and does not stop
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                              pad_token_id=hf.config.pad_token_id or 0)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), generation_config=config)
            outs.append(out[0, len(p):].tolist())
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    import torch

    from kvmesh.engine.builtin import resolve_model_dir
    from kvmesh.common.tokenizer import KVMeshTokenizer
    from kvmesh.engine import LLM, SamplingParams

    model_dir = str(resolve_model_dir(args.model))
    tok = KVMeshTokenizer(model_dir)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
                 "List three fruits.", "How do I boil an egg?", "What does a KV cache store?",
                 "Describe a cat in one sentence.", "Why is the sky blue?"]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    failed = False
    for dtype in ("float32", "bfloat16"):
        expected = hf_greedy(model_dir, getattr(torch, dtype), prompts, args.max_tokens)
        for eager, async_scheduling in ((False, True), (True, True), (False, False)):
            llm = LLM(args.model, dtype=dtype, device="cuda", attention_backend="triton", enforce_eager=eager,
                      gpu_memory_utilization=0.5, max_num_seqs=16, async_scheduling=async_scheduling)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            same = sum(g == e for g, e in zip(got, expected))
            prefix = []
            for g, e in zip(got, expected):
                n = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(e))
                prefix.append(n)
            mode = ("eager" if eager else "cuda-graphs") + (" async" if async_scheduling else " sync")
            print(f"parity {dtype:<9} {mode:<17}: {same}/{len(prompts)} prompts identical to transformers; "
                  f"tokens before first divergence: {prefix} (of {args.max_tokens})", flush=True)
            if dtype == "float32" and same != len(prompts):
                failed = True
            graphs = llm.engine.core.runner.graphs
            if graphs is not None:
                print(f"  decode steps replayed from CUDA graphs: {graphs.num_replays}", flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        if dtype == "float32":  # speculative decoding: verification rows through the Triton backend
            llm = LLM(args.model, dtype=dtype, device="cuda", attention_backend="triton", max_num_seqs=16,
                      gpu_memory_utilization=0.5, speculative_config=SPEC)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            same = sum(g == e for g, e in zip(got, expected))
            s = llm.stats().spec_decode
            print(f"parity {dtype:<9} speculative: {same}/{len(prompts)} prompts identical to transformers; "
                  f"{s.num_drafts} drafts, {s.num_accepted_tokens}/{s.num_draft_tokens} draft tokens accepted",
                  flush=True)
            failed |= same != len(prompts)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print("PARITY FAIL (fp32 must match exactly)" if failed else "parity ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
