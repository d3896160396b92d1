"""Generation throughput: vlens against Hugging Face `generate`, in one run, as ratios.

    .venv/bin/python benchmarks/bench_generate.py [--prompts 64] [--tokens 64] [--repeats 1]

SmolLM2-135M (the embedded default), float32, this machine's CPU. HF runs `generate` on the whole
batch, left-padded; both sides generate exactly --tokens new tokens per prompt (vlens: ignore_eos,
HF: min_new_tokens), greedy. Rows:
  no capture            vlens vs HF, output tokens/s
  capture 3 layers      vlens capturing blocks.{9,19,29}.hook_resid_post at generated positions vs HF
                        with output_hidden_states=True (the same three layers gathered per step)
  capture overhead      vlens with capture enabled but unused, and with one tap at the last position,
                        against an engine built with enable_capture=False
  mixed lengths         requests wanting 8 .. 2*--tokens new tokens (a seeded mix, as in serving): vlens
                        gives each its own max_tokens; HF's batch runs to the longest and is truncated
  attention patterns    every request capturing blocks.{9,19}.attn.hook_pattern at its last position, as a
                        time ratio to no capture; the peer is HF generate with output_attentions=True
                        (eager attention, every layer and step), as a time ratio to HF plain
Then the host overhead a GPU would expose (--workload tiny, or all): a random Llama of 2 layers, d=64,
vocab 512, where GEMMs cost little; 64 prompts of 8-36 tokens x 64 new tokens, greedy; ms per decode step
for vlens and HF at batch 64 and 8, and one captured layer at generated rows vs none — for the default engine
(decodes on the static path, the C paged kernel) and for one with compile_decode=True (each decode forward
compiled by inductor; the warm-up run compiles).
Then the host's part of a CUDA-graph decode step (--workload tiny): the same model on the static decode
path with async scheduling, its forward replaced by one that returns zero logits, so what is timed is the
work a GPU step leaves to the host (planning, buffers, taps, sampling, stop checks, deltas): ms per decode
step (a run of 1 token taken off, with its prefill) at batch 64 plain, capturing 3 taps at generated rows,
and steered per request, as ratios to HF's whole step; and plain at batch 256.
Then contexts of very different lengths (--workload spread, or all): a random Llama of SmolLM2's widths, 4
layers, 64 prompts of 8-400 tokens x 32 new tokens; decode ms per step of HF's left-padded batch, vlens,
and vlens with every decode in one SDPA call (each row reading the longest context's keys: since the CPU's
decode steps take the static path's C kernel, this changes only the SDPA backend's steps); then, on the
same model, the prefill of 4 prompts extending a cached 1,536-token prefix beside 28 fresh ones, grouped by
queries and keys against by queries alone.
Then sliding windows at a long context (--workload window, or all): a random Gemma 3 of 6 layers (5 local, window
256), 8 prompts of 4,000 tokens; decode ms per step of vlens (local layers read their window's keys), of
vlens reading every key under the mask (in the SDPA backend, which decodes now leave on the CPU), and of HF's
forward step over its cache.
Then latent attention at a long context (--workload latent, or all): a random DeepSeek-V3 of 4 dense layers with
V2-Lite's attention (16 heads), 8 prompts of 2,000 tokens; decode ms per step of vlens caching every head's keys and
values, of vlens with latent_kv_cache, and of HF's forward step over its cache.
Then a hybrid model (--workload hybrid, or all): a random Qwen 3.5 of 8 layers (6 gated delta nets, 2 gated
attention), d=256, 32 prompts of 16-200 tokens x 32 new tokens, greedy: vlens against HF generate (left-padded
batch, its recurrent states in its cache), output tokens/s, and vlens capturing a linear layer's hook_z at the
generated rows against none.
Then a Mamba (--workload mamba, or all): a random Mamba of 8 layers, d=256, 16 states a channel, the same prompts and
steps, against HF generate (its left padding zeroed before the convolution and scan, as HF's mask does); and vlens
capturing a Mamba layer's hook_z at the generated rows against none.
Then a Nemotron-H (--workload nemotron, or all): a random one of 8 layers, each one part alone (3 Mamba 2 mixers, an
attention layer, 4 MLPs), d=256, the same prompts and steps, against HF generate; and a Mamba 2 layer's hook_z.
Then a Falcon-H1 (--workload falcon_h1, or all): a random one of 8 layers, attention beside a Mamba 2 mixer in each,
d=256, the same prompts and steps, against HF generate; and a layer's Mamba 2 hook_z.
Then a DeepSeek-V3 (--workload deepseek, or all): a random one of 8 layers (latent attention, 4 of 16 experts after a
dense layer), d=256, the same prompts and steps, against HF generate (which caches the latents and expands them each
step); a layer's hook_z; and vlens with latent_kv_cache (its cache's bytes a token against the expanded cache's).
The families whose layers keep states (all but DeepSeek) then time two workloads of their prefix cache: a chat's next
turn (each prompt, its reply and 16 tokens more, after the first turn), 32 prompts behind one 128-token system prompt,
and 8 multiple-choice questions of 128 tokens x 4 answers scored by their prompt log-probabilities (lm-eval's
loglikelihood; HF: one forward of the batch), each by HF, vlens without the cache and vlens with it (kept states).
Timings are the best of --repeats runs after a warm-up (the host-overhead and spread cases run in turn; the
window case has no warm-up run: the best of --repeats, each timing its steps after an untimed prefill).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    FalconH1Config,
    Gemma3TextConfig,
    LlamaConfig,
    MambaConfig,
    NemotronHConfig,
    Qwen3_5TextConfig,
)

from vlens import LLM, Capture, SamplingParams, Steer
from vlens.engine.llm_engine import NewRequest
from vlens.loader import resolve_model_path

SUBJECTS = [
    "The history of the printing press", "Photosynthesis in desert plants", "How bridges carry weight",
    "The rules of chess", "Why the sky is blue", "A recipe for bread", "The life of honey bees",
    "Volcanoes and plate tectonics", "The first computers", "How vaccines train the immune system",
    "Ocean currents and climate", "The Roman road network", "Learning a second language",
    "How a jet engine works", "The water cycle", "Black holes",
]
STYLES = ["Explain briefly:", "Write a short story about", "Give three facts about", "Describe, for a child,"]
LAYERS = (9, 19, 29)
CHECKPOINTS = tempfile.TemporaryDirectory()  # the random models' checkpoints, removed at exit


def prompts(n: int) -> list[str]:
    return [f"{STYLES[i % len(STYLES)]} {SUBJECTS[i % len(SUBJECTS)].lower()}." for i in range(n)]


def best_alternating(fns: list, repeats: int) -> list[float]:
    """The best time of each of `fns`, run in turn `repeats` times after a warm-up of each: a slow spell of
    the shared machine then falls on all of them alike."""
    for fn in fns:
        fn()
    times = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - start)
    return times


class HFGreedy:
    """HF `generate` of `texts`, left-padded, greedy, each text exactly `tokens` new tokens (min_new_tokens: the
    same work as the engine's ignore_eos), with forward hooks registered for a run and removed after it."""

    def __init__(self, path, texts: list[str], tokens: int):
        self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.batch, self.tokens = self.tok(texts, return_tensors="pt", padding=True), tokens

    def __call__(self, *register) -> None:
        """One run; each of `register` takes the model and returns the handle of a hook it registered."""
        handles = [r(self.model) for r in register]
        try:
            with torch.inference_mode():
                self.model.generate(**self.batch, max_new_tokens=self.tokens, min_new_tokens=self.tokens,
                                    do_sample=False, pad_token_id=self.tok.pad_token_id)  # fmt: skip
        finally:
            for handle in handles:
                handle.remove()


def print_rows(rows: list[tuple[str, float, float | None, str]], width: int) -> None:
    """A table of (case, tok/s, ratio or None, target) rows under its header."""
    print(f"{'case':<{width}}{'tok/s':>10}{'ratio':>10}  target")
    for name, rate, ratio, target in rows:
        print(f"{name:<{width}}{rate:>10.1f}{'' if ratio is None else f'{ratio:>9.2f}x':>10}  {target}")


def print_versus(tokens: int, times: tuple[float, float, float, float], cases: tuple[str, ...], target: str) -> None:
    """The table of a feature against no feature in vlens and in HF with a hook doing it: `times` of (vlens plain,
    vlens with it, HF plain, HF with the hook) for `tokens` tokens each, `cases` naming the five rows."""
    plain, with_it, hf, hf_with_it = times
    print_rows([
        (cases[0], tokens / plain, None, ""), (cases[1], tokens / with_it, with_it / plain, target),
        (cases[2], tokens / hf, None, ""), (cases[3], tokens / hf_with_it, hf_with_it / hf, "(peer)"),
        (cases[4], tokens / with_it, hf_with_it / with_it, "(no target)"),
    ], max(map(len, cases)) + 4)  # fmt: skip


def best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workload", choices=["smol", "tiny", "spread", "window", "latent", *FAMILIES, "all"],
                    default="all")  # fmt: skip
    args = ap.parse_args()
    if args.workload in ("smol", "all"):
        smol(args)
    if args.workload in ("tiny", "all"):
        host_overhead(args)
    if args.workload in ("spread", "all"):
        spread(args)
    for workload in FAMILIES:
        if args.workload in (workload, "all"):
            family_workload(workload, args.repeats)
    if args.workload in ("window", "all"):
        window(args.repeats)
    if args.workload in ("latent", "all"):
        latent_context(args.repeats)


def smol(args: argparse.Namespace) -> None:
    texts = prompts(args.prompts)
    new_tokens = args.prompts * args.tokens
    path = resolve_model_path(None)

    # every run computes its prompts, as HF's does (the runs repeat them: a prefix cache would skip them)
    llm = LLM(model=str(path), dtype="float32", device="cpu", enable_prefix_caching=False)
    plain = LLM(model=str(path), dtype="float32", device="cpu", enable_capture=False, enable_prefix_caching=False)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok(texts, return_tensors="pt", padding=True)

    def sp(capture=None):
        return SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, capture=capture)

    def hf_generate(hidden: bool):
        with torch.inference_mode():
            out = hf.generate(
                **batch, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                pad_token_id=tok.pad_token_id, output_hidden_states=hidden, return_dict_in_generate=True,
            )
            if hidden:  # what a user keeps: the three layers, generated steps, on the CPU
                [torch.cat([step[layer + 1] for step in out.hidden_states[1:]], dim=1) for layer in LAYERS]

    rng = random.Random(0)
    mixed = [rng.randint(8, 2 * args.tokens) for _ in texts]
    mixed_params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in mixed]

    def hf_mixed():
        with torch.inference_mode():
            out = hf.generate(
                **batch, max_new_tokens=max(mixed), min_new_tokens=max(mixed), do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        return [row[batch["input_ids"].shape[1] :][:m] for row, m in zip(out, mixed)]

    hf_eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

    def hf_attentions():
        with torch.inference_mode():
            out = hf_eager.generate(
                **batch, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                pad_token_id=tok.pad_token_id, output_attentions=True, return_dict_in_generate=True,
            )
            [out.attentions[-1][layer].cpu() for layer in (9, 19)]  # what a user keeps: the last step's

    pattern = Capture(hooks=["blocks.9.attn.hook_pattern", "blocks.19.attn.hook_pattern"], positions="last")
    three = Capture(hooks=[f"blocks.{layer}.hook_resid_post" for layer in LAYERS], positions="generated")
    results = {
        "hf": best(lambda: hf_generate(False), args.repeats),
        "vlens": best(lambda: llm.generate(texts, sp(), use_tqdm=False), args.repeats),
        "hf_hidden": best(lambda: hf_generate(True), args.repeats),
        "vlens_capture": best(lambda: llm.generate(texts, sp(three), use_tqdm=False), args.repeats),
        "plain": best(lambda: plain.generate(texts, sp(), use_tqdm=False), args.repeats),
        "last": best(lambda: llm.generate(texts, sp(Capture(hooks="blocks.15.hook_resid_post", positions="last")), use_tqdm=False), args.repeats),
        "hf_mixed": best(hf_mixed, args.repeats),
        "vlens_mixed": best(lambda: llm.generate(texts, mixed_params, use_tqdm=False), args.repeats),
        "pattern": best(lambda: llm.generate(texts, sp(pattern), use_tqdm=False), args.repeats),
        "hf_attentions": best(hf_attentions, args.repeats),
    }
    tps = {k: new_tokens / v for k, v in results.items()}
    tps["hf_mixed"] = sum(mixed) / results["hf_mixed"]
    tps["vlens_mixed"] = sum(mixed) / results["vlens_mixed"]
    print(f"\nSmolLM2-135M float32, CPU ({torch.get_num_threads()} threads), {args.prompts} prompts x {args.tokens} new tokens")
    rows = [
        ("HF generate, no capture", tps["hf"], None, ""),
        ("vlens, no capture", tps["vlens"], tps["vlens"] / tps["hf"], ">= 3x HF"),
        ("HF generate, output_hidden_states", tps["hf_hidden"], None, ""),
        ("vlens, capture 3 resid_post (generated)", tps["vlens_capture"], tps["vlens_capture"] / tps["hf_hidden"], ">= 3x HF"),
        ("vlens, enable_capture=False", tps["plain"], None, ""),
        ("vlens, capture enabled, unused (time)", tps["vlens"], results["vlens"] / results["plain"], "<= 1.02x"),
        ("vlens, one tap at last position (time)", tps["last"], results["last"] / results["plain"], "<= 1.05x"),
        (f"HF generate, mixed lengths 8..{2 * args.tokens}", tps["hf_mixed"], None, ""),
        (f"vlens, mixed lengths 8..{2 * args.tokens}", tps["vlens_mixed"], tps["vlens_mixed"] / tps["hf_mixed"], "(no target)"),
        ("vlens, 2 patterns at last position (time)", tps["pattern"], results["pattern"] / results["vlens"], "<= 1.10x"),
        ("HF generate, output_attentions (time)", tps["hf_attentions"], results["hf_attentions"] / results["hf"], "(peer)"),
    ]
    print_rows(rows, 44)


def random_llama(prefix_caching: bool = False, config=LlamaConfig, **sizes) -> tuple[LLM, torch.nn.Module]:
    """A random Llama (or another `config` class) of these sizes (vocabulary 512), loaded by vlens and by HF, float32
    on the CPU. Without a prefix cache unless asked: the runs repeat their prompts, which HF computes every time.
    Its checkpoint stays for the run (`llm.model_path`: other engines of the same model)."""
    torch.manual_seed(0)
    path = tempfile.mkdtemp(dir=CHECKPOINTS.name)
    AutoModelForCausalLM.from_config(config(vocab_size=512, **sizes)).save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(model=path, dtype="float32", device="cpu", enable_prefix_caching=prefix_caching), hf


def random_prompts(n: int, shortest: int, longest: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's batch: ids left-padded with 0 (no prompt token is 0), and its attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    return ids, (ids != 0).long()


def host_overhead(args: argparse.Namespace) -> None:
    """ms per decode step on a model whose GEMMs cost almost nothing: what is left is host work."""
    llm, hf = random_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    compiled = LLM(model=llm.model_path, dtype="float32", device="cpu", enable_prefix_caching=False,
                   compile_decode=True)  # fmt: skip
    ids = random_prompts(256, 8, 36)
    steps = args.tokens
    print(f"\nhost overhead: random Llama 2 layers d=64, prompts of 8-36 tokens x {steps} new tokens, greedy")
    print(f"{'case':<44}{'ms/step':>10}{'ratio':>10}  target")
    for batch in (64, 8):
        prompts_ = ids[:batch]
        padded, mask = left_padded(prompts_)

        def hf_run():
            with torch.inference_mode():
                hf.generate(input_ids=padded, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                            do_sample=False, pad_token_id=0)  # fmt: skip

        def vlens_run(capture=None, engine=llm):
            p = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, capture=capture)
            engine.generate(prompts_, p, use_tqdm=False)

        one = Capture(hooks="blocks.1.hook_resid_post", positions="generated")
        runs = [hf_run, vlens_run, lambda: vlens_run(one), lambda: vlens_run(engine=compiled),
                lambda: vlens_run(one, compiled)]  # fmt: skip
        t_hf, t_v, t_cap, t_c, t_c_cap = best_alternating(runs, args.repeats)  # (the warm-up compiles)
        ms = lambda t: 1000 * t / steps  # noqa: E731
        target = "<= 0.5x HF" if batch == 64 else ""
        print(f"{f'HF generate, batch {batch}':<44}{ms(t_hf):>10.2f}")
        print(f"{f'vlens, batch {batch}':<44}{ms(t_v):>10.2f}{t_v / t_hf:>9.2f}x  {target}")
        print(f"{f'vlens, one layer at generated rows, batch {batch}':<44}{ms(t_cap):>10.2f}{t_cap / t_v:>9.2f}x  <= 1.15x")
        print(f"{f'vlens compile_decode, batch {batch}':<44}{ms(t_c):>10.2f}{t_c / t_hf:>9.2f}x  {target}")
        print(f"{f'vlens compile_decode, one layer, batch {batch}':<44}{ms(t_c_cap):>10.2f}{t_c_cap / t_c:>9.2f}x  <= 1.15x")
        if batch == 64:
            host_part(llm, ids, steps, args.repeats, t_hf)
    stats = compiled.stats()  # (a compile that failed leaves every later step eager: the compiled rows say so)
    print(f"compile_decode: {stats.compiled_steps} compiled steps, {stats.static_eager_steps} eager ones, "
          f"{stats.decode_compiles} compiles in {stats.decode_compile_seconds:.1f} s; "
          f"{llm.stats().repeated_steps} of vlens's decode steps repeated the one before")


def host_part(llm: LLM, ids: list[list[int]], steps: int, repeats: int, t_hf: float) -> None:
    """ms per decode step of the static decode path with a forward that computes nothing (zero logits, zero
    captured rows): the host's share of a step whose forward is a CUDA graph replay. At batch 64, plain,
    capturing and steered; plain at batch 256 too (the largest batch, where the work per sequence shows)."""
    prompts_ = ids[:64]
    runner, forward = llm.runner, llm.runner._forward

    def null_forward(meta, ids, taps, num_layers=None, logit_rows=None, backend=None, embeds=None, lora=None):
        if backend is not runner.decode_backend:  # prefill runs for real
            return forward(meta, ids, taps, num_layers, logit_rows, backend, embeds=embeds, lora=lora)
        runner.buffers.flush()
        for t in taps.values():
            if t.gather_out is not None:
                t.gather_out.zero_()
        return None, torch.zeros(len(ids), llm.config.vocab_size)

    taps = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.1.attn.hook_z"]
    three = Capture(taps, positions="generated")
    g = torch.Generator().manual_seed(0)
    vectors = [torch.randn(64, generator=g) for _ in prompts_]
    cases = ["plain", "capture 3 taps (generated)", "a Steer per request"]

    def params(case: str, n: int) -> SamplingParams | list[SamplingParams]:
        kw = dict(max_tokens=n, temperature=0, ignore_eos=True)
        if case == "a Steer per request":
            return [SamplingParams(**kw, interventions=[Steer("blocks.1.hook_resid_post", v)]) for v in vectors]
        return SamplingParams(**kw, capture=three if case.startswith("capture") else None)

    def per_step(prompts: list[list[int]], case: str) -> float:
        """Seconds a decode step: a run of `steps` new tokens less a run of 1 (the prefill, which runs for
        real, taken off)."""
        runs = [best(lambda n=n: llm.generate(prompts, params(case, n), use_tqdm=False), repeats) for n in (steps, 1)]
        return (runs[0] - runs[1]) / (steps - 1)

    static, runner.static_decode, runner._forward = runner.static_decode, True, null_forward
    try:
        times = {case: per_step(prompts_, case) for case in cases}
        t_256 = per_step(ids, "plain")
    finally:
        runner.static_decode, runner._forward = static, forward
    for case, t in times.items():
        label = f"graph step host, {case}"
        print(f"{label:<44}{1000 * t:>10.2f}{t * steps / t_hf:>9.2f}x  (of HF's whole step)")
    label = f"graph step host, plain, batch {len(ids)}"
    print(f"{label:<44}{1000 * t_256:>10.2f}  ({1e6 * t_256 / len(ids):.1f} us a sequence)")


def spread(args: argparse.Namespace) -> None:
    """ms per decode step when the batch's contexts differ widely: each decode reads the keys of its
    SDPA call's longest context, so the backend groups decodes by context (vlens.attention.sdpa._group);
    against the same engine with one group for all decodes, and HF's left-padded batch."""
    import vlens.attention.sdpa as sdpa

    llm, hf = random_llama(prefix_caching=True, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)  # fmt: skip
    ids = random_prompts(64, 8, 400)  # (decode steps are timed: a cached prefill is taken off with the rest)
    padded, mask = left_padded(ids)
    steps = 32

    def hf_run(new: int):
        with torch.inference_mode():
            hf.generate(input_ids=padded, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)  # fmt: skip

    def vlens_run(new: int, one_group: bool):
        floor = sdpa.MIN_PADDED_KEYS
        sdpa.MIN_PADDED_KEYS = 1 << 60 if one_group else floor
        try:
            llm.generate(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), use_tqdm=False)
        finally:
            sdpa.MIN_PADDED_KEYS = floor

    # each case runs `steps` tokens and 1 token: the difference is the decode steps', the prefill taken off
    cases = [lambda: hf_run(steps), lambda: hf_run(1), lambda: vlens_run(steps, False), lambda: vlens_run(1, False),
             lambda: vlens_run(steps, True), lambda: vlens_run(1, True)]  # fmt: skip
    t = best_alternating(cases, args.repeats)
    ms = [1000 * (t[i] - t[i + 1]) / (steps - 1) for i in (0, 2, 4)]
    print(f"\ncontexts of very different lengths: random Llama, SmolLM2's widths, 4 layers; 64 prompts of 8-400 "
          f"tokens x {steps} new tokens, greedy; decode ms/step (a run of 1 token taken off)")  # fmt: skip
    print(f"{'case':<44}{'ms/step':>10}{'ratio':>10}")
    print(f"{'HF generate (left-padded batch)':<44}{ms[0]:>10.2f}")
    print(f"{'vlens, decodes grouped by context':<44}{ms[1]:>10.2f}{ms[1] / ms[0]:>9.2f}x")
    print(f"{'vlens, all decodes in one SDPA call':<44}{ms[2]:>10.2f}{ms[2] / ms[0]:>9.2f}x")
    beside_a_cached_prefix(llm, args.repeats)


def beside_a_cached_prefix(llm: LLM, repeats: int) -> None:
    """Prefill seconds of a step in which 4 prompts extend a cached 1,536-token prefix by 64 tokens and 28
    fresh prompts of 56 tokens arrive: their queries are alike, their keys are not. Grouped by queries and
    keys (vlens) against by queries alone (as before this round), which makes every fresh prompt of the
    call read the longest context's keys. Each run's tokens are new, so only the prefix is cached."""
    import vlens.attention.sdpa as sdpa

    rng = random.Random(1)
    prefix = [rng.randrange(1, 512) for _ in range(1536)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prefix], one, use_tqdm=False)
    group = sdpa._group

    def run(by_queries: bool):
        prompts = [prefix + [rng.randrange(1, 512) for _ in range(64)] for _ in range(4)]
        prompts += [[rng.randrange(1, 512) for _ in range(56)] for _ in range(28)]
        sdpa._group = (lambda q, c: group(q, None)) if by_queries else group  # (no decodes: one token each)
        try:
            llm.generate(prompts, one, use_tqdm=False)
        finally:
            sdpa._group = group

    t_keys, t_queries = best_alternating([lambda: run(False), lambda: run(True)], repeats)
    print("\nprompts beside a cached prefix: 4 x (1,536 cached + 64 new tokens) and 28 x 56 fresh tokens, prefill s")
    print(f"{'case':<44}{'s':>10}{'ratio':>10}")
    print(f"{'vlens, prefill grouped by queries and keys':<44}{t_keys:>10.3f}{t_keys / t_queries:>9.2f}x")
    print(f"{'vlens, grouped by queries alone':<44}{t_queries:>10.3f}")


def decode_seconds(llm: LLM, ids: list[list[int]], steps: int) -> float:
    """Seconds a decode step of `ids` in one batch on `llm`'s engine, the prompts prefilled first (not timed)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    engine.add_requests([NewRequest(p, params) for p in ids])
    while engine.scheduler.waiting or any(seq.num_generated == 0 for seq in engine.scheduler.running):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    while engine.has_work():
        engine.step()
    return seconds


def hf_decode_seconds(hf: torch.nn.Module, ids: list[list[int]], steps: int) -> float:
    """Seconds an HF forward step over its cache, greedy, after the prompts' forward (not timed)."""
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor(ids), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = hf(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - start) / steps


def latent_context(repeats: int, batch: int = 8, context: int = 2000, steps: int = 16) -> None:
    """Decode ms per step at a long context with multi-head latent attention: a random DeepSeek-V3 of 4 dense layers
    with V2-Lite's attention (16 heads of 128 + 64 query and key dims, 128 value dims, a 512-dim latent), 8 prompts
    of 2,000 tokens: vlens's cache of every head's keys and values, against its cache of latents (5.3x fewer bytes a
    token, ~3x the arithmetic a key), and HF's forward step over its cache."""
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                              num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=4,
                              n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=4096)  # fmt: skip
    rng = random.Random(0)
    ids = [[rng.randrange(1, 512) for _ in range(context)] for _ in range(batch)]
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        engines = [LLM(model=tmp, dtype="float32", device="cpu", enable_prefix_caching=False, latent_kv_cache=latent)
                   for latent in (False, True)]  # fmt: skip
    t_expanded, t_latent, t_hf = (min(fn() for _ in range(repeats)) for fn in (
        lambda: decode_seconds(engines[0], ids, steps), lambda: decode_seconds(engines[1], ids, steps),
        lambda: hf_decode_seconds(hf, ids, steps)))  # fmt: skip
    sizes = [cache_bytes(llm) for llm in engines]
    print(f"\nlatent attention at a long context: random DeepSeek-V3, 4 layers of V2-Lite's attention, {batch} prompts "
          f"of {context} tokens; decode ms/step")  # fmt: skip
    print(f"{'case':<44}{'ms/step':>10}{'ratio':>10}")
    print(f"{'HF forward step over its cache':<44}{1000 * t_hf:>10.2f}")
    expanded = f"vlens, keys and values ({sizes[0]:,} B a token)"
    print(f"{expanded:<44}{1000 * t_expanded:>10.2f}{t_expanded / t_hf:>9.2f}x")
    print(f"{f'vlens, latent_kv_cache ({sizes[1]:,} B a token)':<44}{1000 * t_latent:>10.2f}{t_latent / t_hf:>9.2f}x"
          f"  ({t_latent / t_expanded:.2f}x the time of keys and values)")


def window(repeats: int, batch: int = 8, context: int = 4000, steps: int = 30) -> None:
    """Decode ms per step at a long context on a sliding-window model: a random Gemma 3 of 6 layers, 5 of them
    local with a 256-token window, 8 prompts of 4,000 tokens. vlens gathers a local layer's keys from its
    window on (`AttentionGroup.first_key`), against the same engine reading every key under the mask, and
    HF's forward step over its cache (whose local layers keep their window only)."""
    import vlens.attention.sdpa as sdpa

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=256,
                              max_position_embeddings=8192)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        llm = LLM(model=tmp, dtype="float32", device="cpu", enable_prefix_caching=False)
    rng = random.Random(0)
    ids = [[rng.randrange(1, 512) for _ in range(context)] for _ in range(batch)]

    def vlens_steps(whole_keys: bool) -> float:
        first_key = sdpa.AttentionGroup.first_key
        if whole_keys:
            sdpa.AttentionGroup.first_key = lambda self, window: 0
        try:
            return decode_seconds(llm, ids, steps)
        finally:
            sdpa.AttentionGroup.first_key = first_key

    t_window, t_whole, t_hf = (min(fn() for _ in range(repeats)) for fn in (
        lambda: vlens_steps(False), lambda: vlens_steps(True), lambda: hf_decode_seconds(hf, ids, steps)))  # fmt: skip
    print(f"\nsliding windows at a long context: random Gemma 3, 6 layers (5 local, window 256), {batch} prompts of "
          f"{context} tokens; decode ms/step")  # fmt: skip
    print(f"{'case':<44}{'ms/step':>10}{'ratio':>10}")
    print(f"{'HF forward step over its cache':<44}{1000 * t_hf:>10.2f}")
    print(f"{'vlens, local layers read their window':<44}{1000 * t_window:>10.2f}{t_window / t_hf:>9.2f}x")
    print(f"{'vlens, every key read under the mask':<44}{1000 * t_whole:>10.2f}{t_whole / t_hf:>9.2f}x")


# workload -> (what it runs, its model, a tap of one of its layers, what that layer is)
FAMILIES = {
    "hybrid": ("random Qwen 3.5, 8 layers (6 linear attention), d=256",
               lambda: random_llama(config=Qwen3_5TextConfig, hidden_size=256, intermediate_size=768,
                                    num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                                    linear_value_head_dim=32, max_position_embeddings=1024),
               "blocks.1.linear_attn.hook_z", "a linear layer"),
    "mamba": ("random Mamba, 8 layers, d=256, 16 states a channel", lambda: random_llama(
        config=MambaConfig, hidden_size=256, num_hidden_layers=8, state_size=16), "blocks.1.mamba.hook_z",
              "a Mamba layer"),
    "nemotron": ("random Nemotron-H, 8 layers (3 Mamba 2, 1 attention, 4 MLP), d=256", lambda: random_llama(
        config=NemotronHConfig, hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, mamba_num_heads=8, mamba_head_dim=64, n_groups=2, ssm_state_size=64, max_position_embeddings=1024,
        layers_block_type=["linear_attention", "mlp"] * 2 + ["full_attention", "mlp", "linear_attention", "mlp"]),
                 "blocks.2.mamba.hook_z", "a Mamba 2 layer"),
    "falcon_h1": ("random Falcon-H1, 8 layers (attention beside a Mamba 2 mixer in each), d=256", lambda: random_llama(
        config=FalconH1Config, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
        max_position_embeddings=1024), "blocks.2.mamba.hook_z", "a Mamba 2 mixer"),
    "deepseek": ("random DeepSeek-V3, 8 layers (latent attention; 4 of 16 experts), d=256", lambda: random_llama(
        config=DeepseekV3Config, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, max_position_embeddings=1024), "blocks.2.attn.hook_z",
                 "a latent attention layer"),
}  # fmt: skip


def family_workload(workload: str, repeats: int, steps: int = 32) -> None:
    """A family's model (layers that keep a state: linear attention, Mamba's; DeepSeek's latent attention): vlens's
    prompts in chunks and decode steps over its KV cache and state slots against HF generate over its cache."""
    what, make, hook, layer = FAMILIES[workload]
    llm, hf = make()
    ids = random_prompts(32, 16, 200)
    padded, mask = left_padded(ids)

    def hf_run():
        with torch.inference_mode():
            hf.generate(input_ids=padded, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                        do_sample=False, pad_token_id=0)  # fmt: skip

    def vlens_run(capture=None, engine: LLM = llm):
        engine.generate(ids, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, capture=capture),
                        use_tqdm=False)  # fmt: skip

    one = Capture(hooks=hook, positions="generated")
    runs = [hf_run, vlens_run, lambda: vlens_run(one)]
    latent = None  # (latent attention: also with its cache of latents, latent_kv_cache)
    if llm.config.kv_lora_rank:
        latent = LLM(model=llm.model_path, dtype="float32", device="cpu", enable_prefix_caching=False,
                     latent_kv_cache=True)  # fmt: skip
        runs.append(lambda: vlens_run(engine=latent))
    t_hf, t_v, t_cap, *t_latent = best_alternating(runs, repeats)
    tokens = len(ids) * steps
    print(f"\n{workload}: {what}; {len(ids)} prompts of 16-200 tokens x {steps} new tokens, greedy")
    print(f"{'case':<44}{'tokens/s':>10}{'ratio':>10}")
    print(f"{'HF generate (left-padded batch)':<44}{tokens / t_hf:>10.1f}")
    print(f"{'vlens':<44}{tokens / t_v:>10.1f}{t_hf / t_v:>9.2f}x")
    print(f"{f'vlens, {layer} at generated rows':<44}{tokens / t_cap:>10.1f}{t_cap / t_v:>9.2f}x  (time vs none)")
    if llm.runner.stateful:
        kept_states(llm, hf, ids, steps, repeats)
    if latent is not None:
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        greedy = [[o.outputs[0].token_ids for o in m.generate(ids, params, use_tqdm=False)] for m in (latent, llm)]
        print(f"{'vlens, latent_kv_cache':<44}{tokens / t_latent[0]:>10.1f}{t_hf / t_latent[0]:>9.2f}x  "
              f"({t_latent[0] / t_v:.2f}x the expanded cache's time; greedy tokens "
              f"{'equal' if greedy[0] == greedy[1] else 'DIFFER'})")
        print(f"KV cache a token: {cache_bytes(latent):,} bytes latent, {cache_bytes(llm):,} expanded "
              f"({cache_bytes(llm) / cache_bytes(latent):.1f}x)")


def cache_bytes(llm: LLM) -> int:
    """What a token takes in the KV cache (float32), keys and values of every layer."""
    return sum(2 * a.num_kv_heads * a.head_dim * 4 for a in llm.model.attention_layers())

def kept_states(llm: LLM, hf: torch.nn.Module, ids: list[list[int]], steps: int, repeats: int) -> None:
    """Where a model whose layers keep states gains from its prefix cache: a chat's next turn (each prompt, its reply
    and 16 tokens more), a batch behind one system prompt (128 tokens, then each prompt's own 16-64), and lm-eval's
    multiple choice (8 questions of 128 tokens x 4 answers of 4-12, scored by their prompt log-probabilities). vlens
    with the cache (reset before each run; the next turn's first turn run again, untimed, for its kept states), vlens
    without it, and HF (generate; for the choices one forward of the batch), which keeps nothing across calls."""
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    turns = [p + r + q for p, r, q in zip(ids, first, random_prompts(len(ids), 16, 16))]
    system = random_prompts(1, 128, 128)[0]
    behind = [system + p for p in random_prompts(len(ids), 16, 64)]
    choices = [q + a for q in random_prompts(8, 128, 128) for a in random_prompts(4, 4, 12)]
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    cached = LLM(model=llm.model_path, dtype="float32", device="cpu")

    def hf_generate(padded: torch.Tensor, mask: torch.Tensor) -> None:
        with torch.inference_mode():
            hf.generate(input_ids=padded, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                        do_sample=False, pad_token_id=0)  # fmt: skip

    def hf_score(padded: torch.Tensor, mask: torch.Tensor) -> None:
        with torch.inference_mode():
            hf(input_ids=padded, attention_mask=mask).logits.log_softmax(-1)

    cases = [("next turn (tokens)", turns, ids, params, hf_generate, len(turns) * steps),
             ("one system prompt (tokens)", behind, None, params, hf_generate, len(behind) * steps),
             ("multiple choice (answers)", choices, None, scored, hf_score, len(choices))]  # fmt: skip
    for name, prompts, before, sampling, hf_fn, count in cases:
        batch = left_padded(prompts)

        def with_cache(timed: list[float], prompts=prompts, before=before, sampling=sampling) -> None:
            cached.reset_prefix_cache()
            if before is not None:
                cached.generate(before, params, use_tqdm=False)
            start = time.perf_counter()
            cached.generate(prompts, sampling, use_tqdm=False)
            timed.append(time.perf_counter() - start)

        kept: list[float] = []
        runs = [lambda: hf_fn(*batch), lambda: llm.generate(prompts, sampling, use_tqdm=False),
                lambda: with_cache(kept)]  # fmt: skip
        t_hf, t_plain, _ = best_alternating(runs, repeats)
        t_kept = min(kept)
        print(f"{f'{name}: HF':<44}{count / t_hf:>10.1f}")
        print(f"{f'{name}: vlens, no prefix cache':<44}{count / t_plain:>10.1f}{t_hf / t_plain:>9.2f}x")
        print(f"{f'{name}: vlens, kept states':<44}{count / t_kept:>10.1f}{t_hf / t_kept:>9.2f}x"
              f"  ({t_kept / t_plain:.2f}x the time without)")


if __name__ == "__main__":
    main()
