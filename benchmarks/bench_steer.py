"""Steering cost: a 64-prompt batch where every request carries its own steering vector, against the
same batch unsteered, in one run.

    .venv/bin/python benchmarks/bench_steer.py [--prompts 64] [--tokens 32] [--repeats 2]

SmolLM2-135M float32 on this CPU, greedy, ignore_eos so both runs do the same work. Each request
steers blocks.10.hook_resid_post at every position with a different random vector. Target: the
steered batch takes at most 1.10x the time of the plain one.

Then a steering-strength sweep: 8 scales of one Steer at the generated rows of one ~400-token prompt, one
call (the prompt computed once: the steered requests share what comes before their first steered row), vs
HF `generate` of the 8 as one batch with the same per-row steer in a forward hook.

Then a TransformerLens-style steering hook (`resid[:, -1] += v` at blocks.10.hook_resid_pre) during
`HookedLM.generate` of 8 prompts x --tokens, with its KV cache and without, against HF `generate` of the
same left-padded batch with the same edit in a forward hook (a KV cache, the new token last).
"""

from __future__ import annotations

import argparse

import torch
from bench_generate import best, best_alternating, prompts
from transformers import AutoModelForCausalLM

from vlens import LLM, HookedLM, SamplingParams, Steer
from vlens.loader import resolve_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    per_request(args)
    strength_sweep(args.tokens // 2, args.repeats)
    hook_steering(args.tokens, args.repeats)


def strength_sweep(steps: int, repeats: int, scales=(-4, -2, -1, 0, 1, 2, 4, 8)) -> None:
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=False)  # (what one call shares, nothing kept)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32).eval()
    ids = llm.tokenizer(" ".join(prompts(48)))["input_ids"][:400]
    vector = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                       interventions=[Steer("blocks.10.hook_resid_post", vector, scale=s, positions="generated")])
        for s in scales
    ]  # fmt: skip
    out = {}

    def ours():
        out["vlens"] = [o.outputs[0].token_ids for o in llm.generate([ids] * len(scales), params, use_tqdm=False)]

    def theirs():
        shift = torch.tensor(scales, dtype=torch.float32)[:, None] * vector

        def steer(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.shape[1] == 1:  # a generated token's row (the prompt's rows come in one forward)
                hidden[:, -1] += shift

        handle = hf.model.layers[10].register_forward_hook(steer)
        try:
            with torch.inference_mode():
                batch = torch.tensor([ids] * len(scales))
                tokens = hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=steps,
                                     min_new_tokens=steps, do_sample=False)  # fmt: skip
        finally:
            handle.remove()
        out["hf"] = tokens[:, len(ids) :].tolist()

    t_vlens, t_hf = best_alternating([ours, theirs], repeats)
    same = sum(a == b for a, b in zip(out["vlens"], out["hf"]))
    print(f"\nsteering-strength sweep: {len(scales)} scales at the generated rows of one {len(ids)}-token prompt, "
          f"{steps} new tokens; greedy tokens equal to HF's for {same} of {len(scales)}")  # fmt: skip
    print(f"{'case':<52}{'s':>8}{'vs HF':>10}")
    print(f"{'HF generate, the 8 as one batch, a forward hook':<52}{t_hf:>8.2f}{1.0:>9.2f}x")
    print(f"{'vlens, one call (the prompt computed once)':<52}{t_vlens:>8.2f}{t_vlens / t_hf:>9.2f}x")


def per_request(args: argparse.Namespace) -> None:
    llm = LLM(dtype="float32", device="cpu")
    texts = prompts(args.prompts)
    g = torch.Generator().manual_seed(0)
    plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    steered = [
        SamplingParams(
            max_tokens=args.tokens, temperature=0, ignore_eos=True,
            interventions=[Steer("blocks.10.hook_resid_post", torch.randn(llm.config.hidden_size, generator=g), scale=2.0)],
        )
        for _ in texts
    ]
    t_plain = best(lambda: llm.generate(texts, plain, use_tqdm=False), args.repeats)
    t_steer = best(lambda: llm.generate(texts, steered, use_tqdm=False), args.repeats)
    tokens = args.prompts * args.tokens
    print(f"\nSmolLM2-135M float32, CPU, {args.prompts} prompts x {args.tokens} new tokens")
    print(f"{'case':<40}{'tok/s':>10}{'time ratio':>12}  target")
    print(f"{'no steering':<40}{tokens / t_plain:>10.1f}{1.0:>11.2f}x")
    print(f"{'a different Steer per request':<40}{tokens / t_steer:>10.1f}{t_steer / t_plain:>11.2f}x  <= 1.10x")


def hook_steering(steps: int, repeats: int, batch: int = 8) -> None:
    hooked = HookedLM(dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32).eval()
    vector = 2 * torch.randn(hooked.cfg.hidden_size, generator=torch.Generator().manual_seed(0))

    def steer(resid, hook):
        resid[:, -1] += vector

    texts = prompts(batch)
    tokenizer = hooked.tokenizer
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True)

    def ours(cached: bool):
        with hooked.hooks([("blocks.10.hook_resid_pre", steer)]):
            hooked.generate(texts, max_new_tokens=steps, do_sample=False, stop_at_eos=False,
                            use_past_kv_cache=cached, verbose=False)  # fmt: skip

    def theirs():
        handle = hf.model.layers[10].register_forward_pre_hook(lambda m, a: steer(a[0], None))
        try:
            with torch.inference_mode():
                hf.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        finally:
            handle.remove()

    t_hf, t_cached, t_whole = best_alternating([theirs, lambda: ours(True), lambda: ours(False)], repeats)
    print(f"\nsteering hook in generate: {batch} prompts x {steps} new tokens, `with model.hooks(...)`")
    print(f"{'case':<52}{'s':>8}{'vs HF':>10}")
    print(f"{'HF generate, the edit in a forward pre-hook':<52}{t_hf:>8.2f}{1.0:>9.2f}x")
    print(f"{'HookedLM.generate, use_past_kv_cache=True':<52}{t_cached:>8.2f}{t_cached / t_hf:>9.2f}x")
    print(f"{'HookedLM.generate, use_past_kv_cache=False':<52}{t_whole:>8.2f}{t_whole / t_hf:>9.2f}x")


if __name__ == "__main__":
    main()
