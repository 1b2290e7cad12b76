#!/usr/bin/env python3
"""GPU greedy parity: kvmesh (Triton backend, CUDA graphs and eager) against transformers on the
same GPU, fp32 and bf16, on the built-in model (part of bench/gpu_check.sh); async scheduling
(the CUDA default) with graphs and eager, and synchronous with graphs.

fp32 must match token for token (the kernels multiply in IEEE fp32, not TF32), also with speculative
decoding (n-gram drafts verified through the Triton backend), except at a near-tie: where the two
first differ, transformers' own logits of its token and the engine's must be within NEAR_TIE (the
random-weight checkpoint that stands in for the built-in model on a machine without it has flat
logits, where summation order alone can flip an argmax). Exit 1 otherwise; the gaps are printed.
bf16 is reported (prompts identical, tokens matching before the first divergence): two bf16
implementations round differently, so a late divergence on a near-tie is expected.
"""

from __future__ import annotations

import argparse
import gc
import sys


# fp32: a divergence passes only at a near-tie, where transformers' own logits for the two tokens
# differ by less than this (two fp32 implementations summing in different orders, over 30 layers).
NEAR_TIE = 1e-3
# Drafts from single-token matches too, always on: random weights rarely repeat a 2-gram.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "acceptance_threshold": 0.0, "disable_by_batch_size": None}


def hf_greedy(model_dir, dtype, prompts, max_new_tokens, attn_implementation="sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers import GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                              attn_implementation=attn_implementation).cuda().eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: EOS may be generated, and does not stop
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                              pad_token_id=hf.config.pad_token_id or 0, return_dict_in_generate=True,
                              output_logits=True)
    outs, logits = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            # An explicit mask: the chat template's <|im_end|> is the pad id, which generate() would
            # otherwise take for padding and mask out of the prompt.
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(out.sequences[0, len(p):].tolist())
            logits.append([step[0].float().cpu() for step in out.logits])
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return outs, logits


def first_divergence(got: list[int], expected: list[int]) -> int:
    """The number of tokens the two agree on before they first differ (all of them if never)."""
    return next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), len(expected))


def divergence_gaps(got, expected, logits) -> list[tuple[int, int, float]]:
    """(prompt, position, gap) at each prompt's first divergence: how far below transformers' best
    logit the engine's token scored there. Both agree on every token before it, so transformers'
    logits at that position are the ones the engine computed too, up to rounding: a gap within
    rounding (a near-tie) says the two computed the same thing; a larger one, a real difference."""
    gaps = []
    for i, (g, e) in enumerate(zip(got, expected)):
        n = first_divergence(g, e)
        if n < len(e):
            row = logits[i][n]
            gaps.append((i, n, float(row[e[n]] - row[g[n]])))
    return gaps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reference-dtype", default=None,
                    help="transformers' dtype for the fp32 reference (float64: which side rounds off)")
    ap.add_argument("--hf-attention", default="sdpa", help="transformers' attn_implementation (sdpa, eager)")
    ap.add_argument("--engine-modes", default="graphs-async,eager-async,graphs-sync,spec")
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
    modes = args.engine_modes.split(",")
    for dtype in args.dtypes.split(","):
        ref = args.reference_dtype if dtype == "float32" and args.reference_dtype else dtype
        expected, hf_logits = hf_greedy(model_dir, getattr(torch, ref), prompts, args.max_tokens, args.hf_attention)
        if ref != dtype or args.hf_attention != "sdpa":
            print(f"reference: transformers {ref}, attention {args.hf_attention}", flush=True)
        for eager, async_scheduling in [(m.startswith("eager"), m.endswith("-async")) for m in modes if m != "spec"]:
            llm = LLM(args.model, dtype=dtype, device="cuda", attention_backend="triton", enforce_eager=eager,
                      gpu_memory_utilization=0.5, max_num_seqs=16, async_scheduling=async_scheduling)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            same = sum(g == e for g, e in zip(got, expected))
            prefix = [first_divergence(g, e) for g, e in zip(got, expected)]
            mode = ("eager" if eager else "cuda-graphs") + (" async" if async_scheduling else " sync")
            gaps = divergence_gaps(got, expected, hf_logits)
            worst = max((gap for _, _, gap in gaps), default=0.0)
            print(f"parity {dtype:<9} {mode:<17}: {same}/{len(prompts)} prompts identical to transformers; "
                  f"tokens before first divergence: {prefix} (of {args.max_tokens}); logit gap at each "
                  f"divergence: {[round(gap, 6) for _, _, gap in gaps]}", flush=True)
            if dtype == "float32" and worst > NEAR_TIE:
                failed = True
            if llm.engine.core.runner.graphs is not None:
                print(f"  decode steps replayed from CUDA graphs: {llm.engine.core.runner.graphs.num_replays}",
                      flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        if dtype == "float32" and "spec" in modes:  # speculative decoding: verification rows through the Triton backend
            llm = LLM(args.model, dtype=dtype, device="cuda", attention_backend="triton", max_num_seqs=16,
                      gpu_memory_utilization=0.5, speculative_config=SPEC)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            same = sum(g == e for g, e in zip(got, expected))
            s = llm.stats().spec_decode
            gaps = divergence_gaps(got, expected, hf_logits)
            print(f"parity {dtype:<9} speculative: {same}/{len(prompts)} prompts identical to transformers; "
                  f"{s.num_drafts} drafts, {s.num_accepted_tokens}/{s.num_draft_tokens} draft tokens accepted; "
                  f"logit gap at each divergence: {[round(gap, 6) for _, _, gap in gaps]}", flush=True)
            failed |= max((gap for _, _, gap in gaps), default=0.0) > NEAR_TIE
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print(f"PARITY FAIL (fp32: a divergence with a logit gap above {NEAR_TIE})" if failed else "parity ok",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
