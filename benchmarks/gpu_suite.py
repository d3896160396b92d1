"""The GPU suite: exactness and speed of vlens against HF on one CUDA GPU, in one run, as ratios.

    python benchmarks/gpu_suite.py [--quick] [--out gpu_suite.json] [--sections exact,generate,...]

No downloads and nothing that cannot travel to a device machine: every model is random weights with a real
model's config, made here (SmolLM2-135M's for float32 exactness, Llama-3.2-1B's for speed in bf16). Every
section runs under its own time guard and try/except, and the JSON is rewritten after each, so a failed or
slow section costs only itself. Sections:
  exact     SmolLM2-shape, float32, TF32 off: every tap of a packed trace vs HF computed on the CPU; a paged
            generation with graphs on, 3 layers + logits captured at every row, vs HF's forward of prompt +
            output on the CPU; greedy tokens vs HF's; the same generation in prefill chunks of 64 tokens vs
            the whole-prompt one, in float32 and (prompt rows, within 1e-2) in bfloat16
  generate  bf16 Llama-3.2-1B shape, 256 prompts of 32-512 tokens x 128 new tokens: vlens (graphs, eager) vs
            HF generate in left-padded batches of 64; capture of 3 layers at every generated row, a different
            Steer per request, both: time vs plain, graphs on; and ("latency_ms") one decode step at batch
            1 and 64 (ms), graphs on and off, and graphs without async scheduling
  profile   decode runs at batch 1 and 64 under torch.profiler: share of wall time the GPU is busy, device ops
            per graph launch, top host and device operators; the batch-64 run under cProfile: top Python functions
  harvest   one layer, 192 windows of 1024 tokens, bf16 (benchmarks/bench_harvest_gpu.py's measure): tokens/s,
            model FLOPs utilisation of the layers run vs the measured peak, vs HF stopped by a hook at its best
            batch and HF output_hidden_states
  hooked    SmolLM2-shape, float32, TF32 off, HookedLM on the GPU vs on the CPU: a resid_pre and a pattern
            patching sweep (vlens.patching: KV-cache copies resumed at a layer) and greedy generate with a hook
            steering resid[:, -1] (over the KV cache), and the loss's gradients at three hooks (a pattern's among
            them; run_with_cache(incl_bwd=True)): the metrics, tokens and gradients, and the seconds each took
  gemma4    Gemma 4 in E2B's layout, narrow, its heads of 256 and 512 dims, float32: every tap vs HF on the CPU,
            greedy generation through the graphs (a shared key-value layer's rows captured) vs HF
  qwen3_5   Qwen 3.5 in 0.8B's layout, narrow, its heads of 256 (attention) and 128 (linear attention): the same,
            a linear layer's rows captured through its state slots
  bamba     Bamba's layout (Mamba 2 mixers), narrow, its released SSM head and state sizes: the same, a Mamba 2
            layer's scan output captured through its state slots
  mamba     Mamba in mamba-130m's layout (no attention, no MLP), its released state size: the same, a layer's scan
            output captured through its state slots
  nemotron_h  Nemotron-H with Nemotron Nano 2's head sizes and Nemotron 3's experts, narrow: the same, a Mamba 2
            layer's scan output and an MoE layer's chosen experts captured
  falcon_h1 Falcon-H1 with its 0.5B's head sizes and µP multipliers, narrow: the same, a layer's two mixers' outputs
  deepseek  DeepSeek-V3 with its released latent and head sizes (q and k 192, v 128), grouped experts, narrow: the
            same, a layer's hook_z and chosen experts
  llama4    Llama 4 in Scout's layout (heads of 128, a NoPE layer in four with its temperature, experts that read
            their input weighed beside a shared one), narrow: the same, a NoPE layer's q and an MoE layer's experts
  images    a LLaVA (CLIP tower, Llama text model) and a Gemma 3 (SigLIP, its images' tokens attending to each other
            both ways) with their processors and a word-level tokenizer made here, float32: every tap at every row of
            two image prompts traced beside a text vs HF's multimodal forward on the CPU given the same pixels,
            greedy generation vs HF generate, and a harvest of the image prompts as records of a text and PNG
            files (`image_field`) vs the trace (needs Pillow)
Timings are the fastest of 2 runs (decode steps: of 3) after a warm-up run.
--quick shrinks every workload (a smoke test of the script itself). --device cpu (with --quick's workloads,
the harvest's 4 windows) runs every section on the CPU over narrow layers (NARROW: same vocabularies and
depths, 64-128 wide), in ~3 minutes on 2 cores: its numbers mean nothing, but the sections' code, the guards
and the JSON run there, on the installed torch and transformers, before a device lease is spent on them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, LlamaConfig

from vlens import LLM, SAE, Capture, Clamp, SamplingParams, Steer

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                rope_theta=500000.0, tie_word_embeddings=True)  # fmt: skip
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
               rms_norm_eps=1e-5)  # fmt: skip
# --device cpu: the layers narrowed, so that every section runs in seconds there
NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def shape(config: dict, device: str) -> dict:
    """`config` as the suite runs it on `device`: as it is on CUDA, NARROW on the CPU."""
    return config if device == "cuda" else {**config, **NARROW}


def sync() -> None:
    """Wait for the GPU, where there is one (the CPU's work is done when its call returns)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Guard:
    """Runs sections, each under SIGALRM after `seconds`, and writes the rows after each."""

    def __init__(self, out: Path, rows: dict):
        self.out, self.rows = out, rows

    def run(self, name: str, seconds: int, fn, *args) -> None:
        def alarm(signum, frame):
            raise TimeoutError(f"section {name} ran past {seconds} s")

        signal.signal(signal.SIGALRM, alarm)
        signal.alarm(seconds)
        started = time.perf_counter()
        try:
            fn(self.rows, *args)
        except Exception as e:  # noqa: BLE001 - a section's failure is recorded, the suite goes on
            self.rows.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            signal.alarm(0)
            self.rows.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
            torch.cuda.empty_cache()
            self.out.write_text(json.dumps(self.rows, indent=2, default=str))
            print(f"[{name}] {self.rows['seconds'][name]} s", flush=True)


def timed(fn, runs: int = 1) -> float:
    """Seconds of the fastest of `runs` calls after a warm-up call (graph captures, lazy inits): the device
    machine's host is shared, and a slow outlier says nothing about either side."""
    fn()
    best = float("inf")
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def random_checkpoint(config, root: Path, name: str, dtype: torch.dtype, device: str = "cpu") -> str:
    """A checkpoint of random weights, initialised on `device` (the 1B shape initialises fast on the GPU); a
    multimodal config's, its vision tower's too."""
    path = root / name
    torch.manual_seed(0)
    kind = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device(device):
        model = kind.from_config(config, dtype=dtype)
    with torch.no_grad():  # random norms too, so a tap that skipped a weight would show; and no matrix of zeros
        for n, p in model.named_parameters():  # (Gemma 3's image projection starts so: every image would be zeros)
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
            elif not p.any():
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return str(path)


def exactness(rows: dict, root: Path, quick: bool, device: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_reference import hf_taps, same  # the parity tests' definition of every tap

    path = random_checkpoint(LlamaConfig(**shape(SMOLLM2, device)), root, "smollm2-shape", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # the reference, on the CPU
    llm = LLM(path, dtype="float32", device=device, max_num_seqs=16, kv_cache_memory=2 << 30)
    rng = random.Random(0)
    ids = [rng.randrange(100, 49000) for _ in range(40)]
    got = llm.trace([ids], list(llm.hook_names()))[0]
    ref = {k: v.cpu() for k, v in hf_taps(hf, ids, range(llm.config.num_layers)).items()}
    errs = {
        k: (0.0 if same(got[k], ref[k], 1e-5) else float("inf")) if k.endswith("hook_attn_scores") else
        ((got[k].double() - ref[k].double()).norm() / ref[k].double().norm().clamp_min(1e-30)).item()
        for k in got if k in ref
    }  # fmt: skip
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (5, 17, 40, 64, 100, 150, 230, 300)][: 3 if quick else 8]
    hooks = ["blocks.3.hook_resid_post", "blocks.15.hook_resid_post", "blocks.28.hook_resid_post", "unembed.hook_out"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, capture=Capture(hooks, positions="all"))
    outs = llm.generate(prompts, params, use_tqdm=False)
    worst, equal = 0.0, 0
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            seq = p + o.outputs[0].token_ids
            hf_out = hf(torch.tensor([seq]), output_hidden_states=True)
            hs, logits = hf_out.hidden_states, hf_out.logits[0]
            n = len(seq) - 1  # the last sampled token is never fed
            want = {hooks[0]: hs[4][0, :n], hooks[1]: hs[16][0, :n], hooks[2]: hs[29][0, :n], hooks[3]: logits[:n]}
            for h in hooks:
                worst = max(worst, ((o.activations[h].double() - want[h].double()).norm() / want[h].double().norm()).item())
            hf_tokens = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
            equal += hf_tokens == o.outputs[0].token_ids
    stats = llm.engine.runner.graph_stats
    # recorded now, so that they stay if the checks below run out of time
    rows["exact"] = exact = {
        "trace_taps": len(errs), "trace_max_rel_err": max(errs.values()), "decode_rows": sum(len(p) + 23 for p in prompts),
        "decode_max_rel_err": worst, "greedy_equal": f"{equal}/{len(prompts)}", "graph_steps": stats.graph_steps,
        "ok": max(errs.values()) <= 1e-5 and worst <= 1e-5 and equal == len(prompts),
    }  # fmt: skip
    llm = None
    # the same requests in prefill chunks of 64 tokens: each later chunk reads its cached keys (causal from
    # the bottom right, no mask built)
    chunked = LLM(
        path, dtype="float32", device=device, max_num_seqs=16, kv_cache_memory=2 << 30, max_num_batched_tokens=64
    )
    chunked_worst, chunked_equal = 0.0, 0
    for o, c in zip(outs, chunked.generate(prompts, params, use_tqdm=False)):
        chunked_equal += o.outputs[0].token_ids == c.outputs[0].token_ids
        for h in hooks:
            a, b = o.activations[h].double(), c.activations[h].double()
            chunked_worst = max(chunked_worst, ((a - b).norm() / a.norm()).item())
    chunked = None
    exact.update(chunked_vs_whole_max_rel_err=chunked_worst, chunked_greedy_equal=f"{chunked_equal}/{len(prompts)}",
                 chunked_ok=chunked_worst <= 1e-5 and chunked_equal == len(prompts))  # fmt: skip
    exact.update(interventions_in_graphs(path, prompts, device))
    # bfloat16 prompt rows, whole and in chunks of 64: the chunks after cached keys run Flash Attention's
    # bottom-right causal kernel (float32 takes the memory-efficient one)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, capture=Capture(hooks, positions="all"))
    whole, parts = (
        LLM(path, dtype="bfloat16", device=device, max_num_seqs=16, kv_cache_memory=1 << 30, max_num_batched_tokens=b)
        .generate(prompts, first, use_tqdm=False) for b in (4096, 64)
    )  # fmt: skip
    bf16_worst = max(
        ((o.activations[h].double() - c.activations[h].double()).norm() / o.activations[h].double().norm()).item()
        for o, c in zip(whole, parts) for h in hooks
    )  # fmt: skip
    exact.update(bf16_chunked_vs_whole_max_rel_err=bf16_worst, bf16_chunked_ok=bf16_worst <= 1e-2)
    torch.backends.cuda.matmul.allow_tf32 = True


def interventions_in_graphs(path: str, prompts: list[list[int]], device: str) -> dict:
    """Every kind of edit inside the graph-replayed decode step — a steer, an SAE clamp, a transcoder clamp (its
    coefficient computed at one tap, read at another), a steer of one head's output (an optional hook) — with
    captures beside them, each request its own, against the same requests with every step eager."""
    d, g = shape(SMOLLM2, device)["hidden_size"], torch.Generator().manual_seed(1)

    def coder(hook: str, hook_out: str | None = None) -> SAE:
        return SAE(W_enc=torch.randn(d, 64, generator=g) / d**0.5, b_enc=torch.randn(64, generator=g) * 0.1,
                   W_dec=torch.randn(64, d, generator=g), b_dec=torch.zeros(d), hook=hook, hook_out=hook_out,
                   apply_b_dec_to_input=hook_out is None)  # fmt: skip

    sae, tc = coder("blocks.6.hook_resid_post"), coder("blocks.9.ln2.hook_out", "blocks.9.hook_mlp_out")
    edits = [[Steer("blocks.4.hook_resid_post", torch.randn(d, generator=g), scale=2.0)], [Clamp(sae.hook, sae, 3, 6.0)],
             [Clamp(tc.writes, tc, 5, 4.0)], [Steer("blocks.2.attn.hook_result", torch.randn(d, generator=g), heads=[1])],
             []]  # fmt: skip
    watch = ["blocks.12.hook_resid_post", "blocks.2.attn.hook_result"]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, interventions=edits[i % len(edits)],
                             capture=Capture(watch, positions="generated")) for i in range(len(prompts))]  # fmt: skip
    runs = [LLM(path, dtype="float32", device=device, max_num_seqs=16, kv_cache_memory=2 << 30, enforce_eager=eager)
            for eager in (False, True)]  # fmt: skip
    graphs, eager = (llm.generate(prompts, params, use_tqdm=False) for llm in runs)
    worst = max(((a.activations[h].double() - b.activations[h].double()).norm() / b.activations[h].double().norm())
                .item() for a, b in zip(graphs, eager) for h in watch)  # fmt: skip
    equal = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(graphs, eager))
    return {"edits_graph_steps": runs[0].engine.runner.graph_stats.graph_steps, "edits_graphs_vs_eager_max_rel_err": worst,
            "edits_greedy_equal": f"{equal}/{len(prompts)}", "edits_ok": worst <= 1e-5 and equal == len(prompts)}  # fmt: skip


def sampling(rows: dict, root: Path, quick: bool, device: str) -> None:
    """vLLM's options that change the logits before sampling, on the device, in one batch with the decode graphs on
    (allowed_token_ids, min_tokens against a stop token, logit_bias, repetition_penalty), each request's greedy tokens
    against HF's generate on the CPU with its own processors for the same change."""
    path = random_checkpoint(LlamaConfig(**shape(SMOLLM2, device)), root, "smollm2-shape-sampling", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", device=device, max_num_seqs=8, kv_cache_memory=1 << 30)
    rng = random.Random(2)
    prompt = [rng.randrange(100, 49000) for _ in range(24)]
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    allowed = sorted(set(base[1::2]) | {rng.randrange(100, 49000) for _ in range(20)})
    cases = [  # (params, HF's generate arguments for the same change)
        (plain, {}),
        (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, allowed_token_ids=allowed),
         {"prefix_allowed_tokens_fn": lambda batch, ids: allowed}),
        (SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[base[1]], min_tokens=6),
         {"eos_token_id": base[1], "min_new_tokens": 6}),
        (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logit_bias={base[0]: -100, base[2]: 5.0}),
         {"sequence_bias": {(base[0],): -100.0, (base[2],): 5.0}}),
        (SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.5),
         {"repetition_penalty": 1.5}),
    ]  # fmt: skip
    outs = llm.generate([prompt] * len(cases), [p for p, _ in cases], use_tqdm=False)
    equal = 0
    with torch.inference_mode():
        for (_, options), out in zip(cases, outs, strict=True):
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                               **options)[0, len(prompt) :].tolist()  # fmt: skip
            got = out.outputs[0].token_ids
            equal += got == want[: len(got)] and (len(got) == 16 or got[-1] == base[1])
    rows["sampling"] = {"requests": len(cases), "greedy_equal_hf": f"{equal}/{len(cases)}",
                        "graph_steps": llm.engine.runner.graph_stats.graph_steps, "ok": equal == len(cases)}


def _workload(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 100000) for _ in range(rng.randint(32, 512))] for _ in range(n)]


def generation(rows: dict, path: str, quick: bool, device: str) -> None:
    n, new = (32, 32) if quick else (256, 128)
    prompts = _workload(n)
    plain = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    three = Capture(["blocks.3.hook_resid_post", "blocks.8.hook_resid_post", "blocks.13.hook_resid_post"], positions="generated")
    g = torch.Generator().manual_seed(0)
    hidden = AutoConfig.from_pretrained(path).hidden_size
    steers = [Steer("blocks.8.hook_resid_post", torch.randn(hidden, generator=g)) for _ in prompts]
    out: dict = {}
    for eager in (False, True):
        # every run computes its prompts, as HF's does (the runs repeat them: a prefix cache would skip them)
        llm = LLM(path, dtype="bfloat16", device=device, enforce_eager=eager, enable_prefix_caching=False)

        def run(params, llm=llm):
            return lambda: llm.generate(prompts, params, use_tqdm=False)

        label = "eager" if eager else "graphs"
        out[label] = timed(run(plain), 2)
        if not eager:
            kw = dict(max_tokens=new, temperature=0, ignore_eos=True)
            out["capture"] = timed(run(SamplingParams(**kw, capture=three)), 2)
            out["steer"] = timed(run([SamplingParams(**kw, interventions=[s]) for s in steers]), 2)
            out["both"] = timed(run([SamplingParams(**kw, capture=three, interventions=[s]) for s in steers]), 2)
            stats = llm.engine.runner.graph_stats
            runner = llm.engine.runner
            out["graph_stats"] = {"graph_steps": stats.graph_steps, "eager_steps": stats.eager_steps,
                                  "graphs": stats.graphs_captured, "capture_s": round(stats.capture_seconds, 2),
                                  "ahead_steps": stats.ahead_steps, "repeated_steps": runner.pages.repeats,
                                  "fused": runner.fused,
                                  "paged_kernel": runner.decode_backend.paged is not None}  # fmt: skip
            llm.engine.async_scheduling = False  # each step waits for its ids before the next is planned
            rows.setdefault("latency_ms", {}).update({f"b{b}_graphs_sync": _step_ms(llm, prompts[:b]) for b in (1, 64)})
            llm.engine.async_scheduling = True
        rows.setdefault("latency_ms", {}).update({f"b{b}_{label}": _step_ms(llm, prompts[:b]) for b in (1, 64)})
        del llm
        torch.cuda.empty_cache()
    rows["generate_vlens"] = out
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()

    def hf_generate():
        for i in range(0, len(prompts), 64):
            batch = prompts[i : i + 64]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            with torch.inference_mode():
                hf.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0)  # fmt: skip

    out["hf"] = timed(hf_generate, 2)
    hf = None  # its memory back for the next section
    tokens = n * new
    rows["generate"] = {
        "vlens_tok_s_graphs": tokens / out["graphs"], "vlens_tok_s_eager": tokens / out["eager"], "hf_tok_s": tokens / out["hf"],
        "ratio_vs_hf": out["hf"] / out["graphs"], "capture_vs_plain": out["capture"] / out["graphs"],
        "steer_vs_plain": out["steer"] / out["graphs"], "both_vs_plain": out["both"] / out["graphs"],
    }  # fmt: skip
    lat = rows["latency_ms"]
    lat["graphs_speedup_b1"] = lat["b1_eager"] / lat["b1_graphs"]


def _step_ms(llm: LLM, prompts: list[list[int]]) -> float:
    """ms per decode step: 33 new tokens minus 1, each the best of 3."""
    short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    longer = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    t1 = timed(lambda: llm.generate(prompts, short, use_tqdm=False), 3)
    t33 = timed(lambda: llm.generate(prompts, longer, use_tqdm=False), 3)
    return 1000 * (t33 - t1) / 32


def profile(rows: dict, path: str, quick: bool, device: str) -> None:
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    llm = LLM(path, dtype="bfloat16", device=device)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    out = rows["profile"] = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for b in (1, 64):
        prompts = _workload(b)
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        with torch_profile(activities=activities) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            sync()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.self_device_time_total for e in on_device)
        launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
        host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
        out[f"b{b}"] = {
            "wall_s": wall, "gpu_busy_share": gpu_us / 1e6 / wall, "graph_launches": launches,
            "device_ops_per_launch": sum(e.count for e in on_device) / max(launches, 1),
            "top_host_ops": [(e.key, round(e.self_cpu_time_total / 1e3, 1), e.count) for e in host],
            "top_device_ops": [(e.key[:60], round(e.self_device_time_total / 1e3, 2), e.count)
                               for e in sorted(on_device, key=lambda e: -e.self_device_time_total)[:10]],
        }  # fmt: skip
    out["gpu_busy_share"] = out["b64"]["gpu_busy_share"]
    profiler = cProfile.Profile()  # where the host's time goes, by Python function, batch 64
    profiler.enable()
    llm.generate(_workload(64), params, use_tqdm=False)
    sync()
    profiler.disable()
    table = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: -kv[1][2])[:25]
    out["python_top_tottime_ms"] = [
        (f"{Path(f).name}:{line}:{fn}", round(tt * 1e3, 1), round(ct * 1e3, 1), nc) for (f, line, fn), (_, nc, tt, ct, _) in table
    ]  # fmt: skip


def harvesting(rows: dict, path: str, quick: bool, device: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_harvest_gpu import measure  # the harvest row's own benchmark: vlens vs HF, MFU

    rows["harvest"] = measure(path, 4 if device == "cpu" else 16 if quick else 192, device)


def hooked(rows: dict, root: Path, quick: bool, device: str) -> None:
    from vlens import HookedLM, patching

    torch.backends.cuda.matmul.allow_tf32 = False
    path = random_checkpoint(LlamaConfig(**shape(SMOLLM2, device)), root, "smollm2-hooked", torch.float32)
    models = {where: HookedLM(path, dtype="float32", device=where, kv_cache_memory=1 << 30)
              for where in dict.fromkeys((device, "cpu"))}  # fmt: skip
    rng = random.Random(1)
    clean = torch.tensor([[rng.randrange(100, 49000) for _ in range(12)]])
    corrupted = clean.clone()
    corrupted[0, 6] = 777

    def metric(logits):
        return (logits[:, -1, 7] - logits[:, -1, 11]).mean()

    def steer(resid, hook):
        resid[:, -1] += 4.0

    out: dict = {}
    for where, model in models.items():
        _, cache = model.run_with_cache(clean)
        got = {}
        for name in ("get_act_patch_resid_pre", "get_act_patch_attn_head_pattern_all_pos"):
            start = time.perf_counter()
            got[name] = getattr(patching, name)(model, corrupted, cache, metric).cpu()
            got[f"{name}_s"] = time.perf_counter() - start
        with model.hooks([("blocks.10.hook_resid_pre", steer)]):
            start = time.perf_counter()
            got["tokens"] = model.generate(clean, max_new_tokens=12, do_sample=False, stop_at_eos=False,
                                           return_type="tokens", verbose=False)[0].tolist()  # fmt: skip
            got["generate_s"] = time.perf_counter() - start
        start = time.perf_counter()
        grads = ["blocks.0.hook_resid_pre", "blocks.10.attn.hook_z", "blocks.20.attn.hook_pattern"]
        _, cache = model.run_with_cache(corrupted, names_filter=grads, return_type="loss", incl_bwd=True)
        got["gradients_s"] = time.perf_counter() - start
        got["gradients"] = {name: cache[f"{name}_grad"].cpu() for name in grads}
        out[where] = got
    mine, ref = out[device], out["cpu"]
    rows["hooked"] = {
        **{f"{name}_max_abs_diff": float((mine[name] - ref[name]).abs().max()) for name in
           ("get_act_patch_resid_pre", "get_act_patch_attn_head_pattern_all_pos")},
        "metric_scale": float(ref["get_act_patch_resid_pre"].abs().max()),
        "tokens_equal": mine["tokens"] == ref["tokens"],
        **{f"{name}_grad_rel_err": float((mine["gradients"][name] - g).norm() / g.norm())
           for name, g in ref["gradients"].items()},  # fmt: skip
        **{f"{key}_{where}": got[key] for where, got in out.items() for key in got if key.endswith("_s")},
    }  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = True


def gemma4(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Gemma 4 in E2B's layout (per-layer embeddings, the last two layers reading earlier layers' keys and values),
    narrow, with the released head sizes on CUDA (256 on the sliding layers, 512 on the full ones: the decode
    kernels and the cache at both): `family_check`, capturing a shared layer's rows (layer 4 reads layer 3's keys
    and values)."""
    if (config_class := _config_class(rows, "gemma4", "Gemma4TextConfig", "Gemma 4")) is None:
        return
    wide = device == "cuda"
    kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    config = config_class(
        vocab_size=8192, hidden_size=512 if wide else 64, intermediate_size=1024 if wide else 128, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=256 if wide else 16, global_head_dim=512 if wide else 32,
        sliding_window=32, layer_types=kinds, hidden_size_per_layer_input=64 if wide else 8,
        vocab_size_per_layer_input=8192, num_kv_shared_layers=2, final_logit_softcapping=30.0,
        max_position_embeddings=2048,
    )  # fmt: skip
    rows["gemma4"] = family_check(config, "gemma4-e2b-layout", ["blocks.4.hook_resid_post"], root, quick, device)


def qwen3_5(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Qwen 3.5 in 0.8B's layout (three gated delta nets, then gated attention, twice), narrow, with the released
    head sizes on CUDA (256 on the attention layers, 128 on the linear ones): `family_check`, capturing a linear
    layer's output through its state slots, in the decode steps' graphs."""
    if (config_class := _config_class(rows, "qwen3_5", "Qwen3_5TextConfig", "Qwen 3.5")) is None:
        return
    wide = device == "cuda"
    config = config_class(
        vocab_size=8192, hidden_size=512 if wide else 64, intermediate_size=1024 if wide else 128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=256 if wide else 16, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=128 if wide else 8, linear_value_head_dim=128 if wide else 8,
        max_position_embeddings=2048,
    )  # fmt: skip
    rows["qwen3_5"] = family_check(config, "qwen3_5-0.8b-layout", ["blocks.2.linear_attn.hook_z"], root, quick, device)


def bamba(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Bamba's layout (Mamba 2 mixers, an attention layer among them), narrow, with the released head sizes on CUDA
    (64-dim SSM heads, a 128-wide state, 128-dim attention heads): `family_check`, capturing a Mamba 2 layer's scan
    output through its state slots, in the decode steps' graphs."""
    if (config_class := _config_class(rows, "bamba", "BambaConfig", "Bamba")) is None:
        return
    wide = device == "cuda"
    config = config_class(
        vocab_size=8192, hidden_size=512 if wide else 64, intermediate_size=1024 if wide else 128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=16 if wide else 4, mamba_d_head=64 if wide else 32,
        mamba_n_groups=1, mamba_d_state=128 if wide else 8, attn_layer_indices=[2], max_position_embeddings=2048,
    )  # fmt: skip
    rows["bamba"] = family_check(config, "bamba-layout", ["blocks.1.mamba.hook_ssm_out"], root, quick, device)


def mamba(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Mamba in mamba-130m's layout (its selective scan: no attention, no MLP), narrow on the CPU: `family_check`,
    capturing a layer's scan output through its state slots, in the decode steps' graphs."""
    wide = device == "cuda"
    config = transformers.MambaConfig(vocab_size=8192, hidden_size=768 if wide else 64, num_hidden_layers=4,
                                      state_size=16, expand=2, conv_kernel=4)  # fmt: skip
    rows["mamba"] = family_check(config, "mamba-130m-layout", ["blocks.1.mamba.hook_ssm_out"], root, quick, device)


def nemotron_h(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Nemotron-H with Nemotron Nano 2's head sizes on CUDA (Mamba 2 heads of 80 dims over 8 groups, a 128-wide state,
    attention heads of 128) and Nemotron 3's experts, narrow: `family_check`, capturing a Mamba 2 layer's scan output
    and an MoE layer's chosen experts through the graphs."""
    if (config_class := _config_class(rows, "nemotron_h", "NemotronHConfig", "Nemotron-H")) is None:
        return
    wide = device == "cuda"
    config = config_class(
        vocab_size=8192, hidden_size=512 if wide else 64, intermediate_size=1024 if wide else 96,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128 if wide else 16, mamba_num_heads=16 if wide else 4,
        mamba_head_dim=80 if wide else 32, n_groups=8 if wide else 2, ssm_state_size=128 if wide else 8,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256 if wide else 32,
        moe_shared_expert_intermediate_size=256 if wide else 48, max_position_embeddings=2048,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
    )  # fmt: skip
    hooks = ["blocks.0.mamba.hook_ssm_out", "blocks.1.mlp.hook_expert_ids"]
    rows["nemotron_h"] = family_check(config, "nemotron-h-layout", hooks, root, quick, device)


def falcon_h1(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Falcon-H1 with Falcon-H1-0.5B's head sizes on CUDA (Mamba 2 heads of 64 over one group, a 128-wide state,
    attention heads of 64), its µP multipliers off one, narrow: `family_check`, capturing a layer's two mixers'
    outputs through the graphs."""
    if (config_class := _config_class(rows, "falcon_h1", "FalconH1Config", "Falcon-H1")) is None:
        return
    wide = device == "cuda"
    config = config_class(
        vocab_size=8192, hidden_size=512 if wide else 64, intermediate_size=1024 if wide else 96, num_hidden_layers=4,
        num_attention_heads=8 if wide else 4, num_key_value_heads=2, mamba_d_ssm=1024 if wide else 128,
        mamba_n_heads=16 if wide else 4, mamba_d_head=64 if wide else 32, mamba_n_groups=1,
        mamba_d_state=128 if wide else 8, max_position_embeddings=2048, key_multiplier=0.9,
        attention_out_multiplier=0.6, ssm_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9],
    )  # fmt: skip
    hooks = ["blocks.1.mamba.hook_out", "blocks.1.attn.hook_out"]
    rows["falcon_h1"] = family_check(config, "falcon-h1-layout", hooks, root, quick, device)


def deepseek(rows: dict, root: Path, quick: bool, device: str) -> None:
    """DeepSeek-V3 with its released latent attention sizes on CUDA (a 1536-rank query LoRA, a 512-dim latent, heads of
    128 + 64 dims for queries and keys, 128 for values: padded to 192 in the cache) and grouped routing, narrow:
    `family_check`, capturing a layer's hook_z and an MoE layer's chosen experts through the graphs."""
    if (config_class := _config_class(rows, "deepseek", "DeepseekV3Config", "DeepSeek-V3")) is None:
        return
    wide = device == "cuda"
    config = config_class(
        vocab_size=8192, hidden_size=512 if wide else 64, intermediate_size=1024 if wide else 96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=1536 if wide else 24, kv_lora_rank=512 if wide else 16,
        qk_nope_head_dim=128 if wide else 12, qk_rope_head_dim=64 if wide else 8, v_head_dim=128 if wide else 10,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256 if wide else 32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, max_position_embeddings=2048,
    )  # fmt: skip
    hooks = ["blocks.1.attn.hook_z", "blocks.1.mlp.hook_expert_ids"]
    rows["deepseek"] = family_check(config, "deepseek-v3-layout", hooks, root, quick, device)
    # (the cache of latents: 576 numbers a token and layer, the heads attending through kv_b_proj's rows)
    rows["deepseek"]["latent_kv_cache"] = family_check(config, "deepseek-v3-layout", hooks, root, quick, device,
                                                       latent_kv_cache=True)  # fmt: skip


def llama4(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Llama 4 in Scout's layout on CUDA (heads of 128, rotary by pairs in float32 with weightless q/k norms, every
    fourth layer without rotary and with its temperature, one of 16 experts a token reading its input weighed, beside
    a shared one), narrow: `family_check`, capturing a NoPE layer's q and an MoE layer's chosen experts through the
    graphs; its rotating layers attend within chunks of 32 positions (Scout's are 8,192), which the prompts and their
    generated tokens cross: the prefill's masks and the decode kernel's first keys."""
    if (config_class := _config_class(rows, "llama4", "Llama4TextConfig", "Llama 4")) is None:
        return
    wide = device == "cuda"
    config = config_class(
        vocab_size=8192, hidden_size=512 if wide else 64, intermediate_size=256 if wide else 32,
        intermediate_size_mlp=1024 if wide else 96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128 if wide else 16, num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=32, floor_scale=64, attn_scale=0.1, max_position_embeddings=2048,
    )  # fmt: skip
    hooks = ["blocks.3.attn.hook_q", "blocks.1.mlp.hook_expert_ids"]
    rows["llama4"] = family_check(config, "llama4-scout-layout", hooks, root, quick, device)


def _config_class(rows: dict, section: str, name: str, family: str) -> type | None:
    """transformers' config class `name`, or None, the section's row saying it was skipped, where this transformers
    has no `family`."""
    found = getattr(transformers, name, None)
    if found is None:
        rows[section] = {"skipped": f"transformers {transformers.__version__} has no {family}"}
    return found


def family_check(config, name: str, hooks: list[str], root: Path, quick: bool, device: str, **settings) -> dict:
    """A random checkpoint of `config` in float32, TF32 off: every tap of a packed trace vs HF on the CPU (patterns
    within 1e-4), and greedy generation through the paged cache (graphs on CUDA) capturing `hooks` and the logits
    at every row, vs HF's forward of prompt + output and HF generate; `settings`: the engine's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_reference import hf_taps

    path = random_checkpoint(config, root, name, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", device=device, max_num_seqs=8, kv_cache_memory=1 << 30, **settings)
    rng, layers = random.Random(1), config.num_hidden_layers

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        masked = torch.isinf(b)
        a, b = a[~masked].double(), b[~masked].double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    reference = "every tap (tests/hf_reference.py)"

    def hf_rows(seq: list[int], patterns: bool = True) -> dict[str, torch.Tensor]:
        """HF's taps of `seq`, or, once they fail on this transformers (whose modules tests/hf_reference.py reads
        inside may be laid out otherwise: the device's is older than the CPU's), its residual stream and logits."""
        nonlocal reference
        if reference.startswith("every"):
            try:
                return {k: v.cpu() for k, v in hf_taps(hf, seq, range(layers), patterns=patterns).items()}
            except Exception as e:  # noqa: BLE001 (any failure of the reference's reading of HF's internals)
                reference = f"HF's hidden states and logits alone (its taps failed: {type(e).__name__}: {e})"[:300]
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        stream = {f"hidden_states.{i}": h[0] for i, h in enumerate(out.hidden_states)}
        return stream | {"unembed.hook_out": out.logits[0]}

    ids = [rng.randrange(10, 8000) for _ in range(80)]  # (past the windows, past a 64-token chunk)
    got = llm.trace([ids], list(llm.hook_names()))[0]
    with torch.inference_mode():
        ref = hf_rows(ids)
    try:
        errs = {k: rel(got[k], ref[k]) for k in got if k in ref}
    except (IndexError, RuntimeError):  # (a tap HF's modules of this version shape otherwise)
        reference = "HF's hidden states and logits alone (its taps' shapes differ on this transformers)"
        with torch.inference_mode():
            ref = hf_rows(ids)
        errs = {k: rel(got[k], ref[k]) for k in got if k in ref}
    taps = [e for k, e in errs.items() if not k.endswith(("hook_pattern", "hook_attn_scores"))]
    patterns = [e for k, e in errs.items() if k.endswith(("hook_pattern", "hook_attn_scores"))]
    prompts = [[rng.randrange(10, 8000) for _ in range(n)] for n in (7, 40, 90)][: 2 if quick else 3]
    hooks = [*hooks, f"hidden_states.{layers // 2}", "unembed.hook_out"]  # (the stream: what any reference has)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, capture=Capture(hooks, positions="all"))
    worst, equal = 0.0, 0

    def check(prompt: list[int], out, start: int = 0) -> None:
        """`out`'s rows from position `start` on and its tokens against HF's."""
        nonlocal worst, equal
        seq = prompt + out.outputs[0].token_ids
        n = len(seq) - 1  # the last sampled token is never fed
        want = {k: v[start:n] for k, v in hf_rows(seq, patterns=False).items() if k in hooks}
        worst = max(worst, *(rel(out.activations[h], want[h]) for h in want))
        equal += hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist() == \
            out.outputs[0].token_ids  # fmt: skip

    with torch.inference_mode():
        for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            check(p, o)
        kept = None
        if llm.runner.stateful:  # a chat's next turn (a 100-token prompt, its reply, a new message): from the state
            # its sequence left at its last block boundary, copied there outside the decode steps' graphs
            first = [rng.randrange(10, 8000) for _ in range(100)]
            reply = llm.generate([first], params, use_tqdm=False)[0]
            check(first, reply)
            turn = first + reply.outputs[0].token_ids + [rng.randrange(10, 8000) for _ in range(9)]
            before = llm.stats().tokens_computed
            generated = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                       capture=Capture(hooks, positions="generated"))  # (rows it must compute alone)
            out = llm.generate([turn], generated, use_tqdm=False)[0]
            kept = {"tokens_computed": llm.stats().tokens_computed - before, "without_the_cache": len(turn) + 15,
                    "kept_states": llm.stats().kept_states}  # fmt: skip
            check(turn, out, len(turn))
            prompts = [*prompts, first, turn]
    torch.backends.cuda.matmul.allow_tf32 = True
    return {
        "reference": reference, "trace_taps": len(taps), "trace_max_rel_err": max(taps),
        "pattern_max_rel_err": max(patterns, default=0.0),
        "decode_max_rel_err": worst, "greedy_equal": f"{equal}/{len(prompts)}",
        "graph_steps": llm.engine.runner.graph_stats.graph_steps, **({"next_turn": kept} if kept else {}),
        "ok": max(taps) <= 1e-5 and max(patterns, default=0.0) <= 1e-4 and worst <= 1e-5 and equal == len(prompts)
        and (kept is None or kept["tokens_computed"] < kept["without_the_cache"]),
    }  # fmt: skip


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora(rows: dict, root: Path, quick: bool, device: str) -> None:
    """LoRA adapters beside the base model (enable_lora): a random SmolLM2-shape model (8 layers) in float32, two
    rank-16 adapters of every projection written as PEFT saves them (the device has no PEFT), a third of 24 prompts
    under each and a third under none in one batch, decode steps through graphs; against HF on the CPU with each
    adapter merged into its weights: greedy tokens and a layer's rows at every generated row. Then, in bfloat16 on
    the 1B-ish shape's widths, the time of that mixed batch against the base model's alone (graphs on)."""
    from safetensors.torch import save_file

    from vlens import LoRARequest

    torch.backends.cuda.matmul.allow_tf32 = False
    config = LlamaConfig(**shape(SMOLLM2 | dict(num_hidden_layers=8), device))
    path = random_checkpoint(config, root, "lora-base", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    merged, requests = [], []
    for i in range(2):
        g, tensors = torch.Generator().manual_seed(i), {}
        adapted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, module in adapted.named_modules():
            if name.endswith(LORA_TARGETS):
                a = torch.randn(16, module.in_features, generator=g) / module.in_features**0.5
                b = torch.randn(module.out_features, 16, generator=g) * 0.02
                key = f"base_model.model.{name}"
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
                with torch.no_grad():
                    module.weight += (b @ a) * 2.0  # (lora_alpha 32 / r 16)
        directory = root / f"lora-{i}"
        directory.mkdir()
        save_file(tensors, directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": list(LORA_TARGETS),
            "base_model_name_or_path": path}))  # fmt: skip
        merged.append(adapted)
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(directory)))
    llm = LLM(path, dtype="float32", device=device, enable_lora=True, max_loras=2, kv_cache_memory=1 << 30)
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randint(8, 64))] for _ in range(12 if quick else 24)]
    under = [[None, *requests][i % 3] for i in range(len(prompts))]
    hook = "blocks.4.hook_resid_post"
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, capture=Capture(hook, positions="generated"))
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=under)
    worst, equal = 0.0, 0
    for prompt, out, request in zip(prompts, outs, under):
        model = hf if request is None else merged[request.lora_int_id - 1]
        with torch.inference_mode():
            seq = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0]  # fmt: skip
            want = model(seq[None, :-1], output_hidden_states=True).hidden_states[5][0, len(prompt) :]
        equal += seq[len(prompt) :].tolist() == out.outputs[0].token_ids
        got = out.activations[hook].float().cpu()
        worst = max(worst, ((got - want).norm() / want.norm()).item())
    result = {"decode_max_rel_err": worst, "greedy_equal": f"{equal}/{len(prompts)}",
              "graph_steps": llm.runner.graph_stats.graph_steps, "ok": worst <= 1e-5 and equal == len(prompts)}
    torch.backends.cuda.matmul.allow_tf32 = True
    if device == "cuda":  # the adapters' cost with graphs on, in bfloat16
        fast = LLM(path, dtype="bfloat16", device=device, enable_lora=True, max_loras=2, enable_prefix_caching=False)
        batch = [[rng.randrange(10, 8000) for _ in range(rng.randint(32, 512))] for _ in range(64)]
        plain = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        mixed = [[None, *requests][i % 3] for i in range(len(batch))]
        t_base = timed(lambda: fast.generate(batch, plain, use_tqdm=False), 2)
        t_mixed = timed(lambda: fast.generate(batch, plain, use_tqdm=False, lora_request=mixed), 2)
        result |= {"base_s": t_base, "mixed_s": t_mixed, "mixed_vs_base": t_mixed / t_base}
    rows["lora"] = result


def images(rows: dict, root: Path, quick: bool, device: str) -> None:
    """Prompts with images (vlens.images), the tower on the device as the model: a LLaVA, a Gemma 3 (its images'
    tokens attend to each other both ways in the prefill), a Qwen2-VL (its rows' rotary positions are three, a static
    buffer of the decode step's graphs) and a Qwen3-VL (the same interleaved, and its deepstack rows). No tokenizer
    files travel, so the processors' are word-level, made from the prompts' words."""
    torch.backends.cuda.matmul.allow_tf32 = False
    rows["images"] = {}
    for name in ("llava", "gemma3", "qwen2_vl", "qwen3_vl"):
        try:
            rows["images"][name] = _image_check(name, root, device)
        except Exception as e:  # noqa: BLE001 (e.g. a processor this transformers builds with torchvision alone)
            rows["images"][name] = {"error": f"{type(e).__name__}: {e}"[:300], "ok": False}
            traceback.print_exc()
    rows["images"]["ok"] = all(r["ok"] for r in rows["images"].values())
    torch.backends.cuda.matmul.allow_tf32 = True


def _image_check(name: str, root: Path, device: str) -> dict:
    """Every tap at every row of two image prompts traced beside a text vs HF's multimodal forward on the CPU given
    the same pixels, and greedy generation vs HF generate, on a random checkpoint of `name` (llava, gemma3,
    qwen2_vl, qwen3_vl)."""
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        Gemma3Config,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        LlavaConfig,
        LlavaProcessor,
        PreTrainedTokenizerFast,  # fmt: skip
        Qwen2VLConfig,
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        SiglipVisionConfig,
    )

    from vlens.images import images_only_processor

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_reference import hf_taps

    gemma, qwen = name == "gemma3", name in ("qwen2_vl", "qwen3_vl")
    # (where a prompt puts an image)
    mark = "<start_of_image>" if gemma else "<|vision_start|><|image_pad|><|vision_end|>" if qwen else "<image>"
    texts = [f"USER: {mark} what is in this picture ? ASSISTANT:", f"compare {mark} with {mark} please",
             "a text without a picture"]  # fmt: skip
    words = sorted({w for t in texts for w in t.split()} - {mark})
    words = words + [f"w{i}" for i in range(500 - len(words))]  # (a vocabulary the random model generates into)
    backend = Tokenizer(models.WordLevel({w: i + 1 for i, w in enumerate(words)} | {"<unk>": 0}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>",
                                  **({"extra_special_tokens": specials} if gemma else {}))  # fmt: skip
    qwen_tokens = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    if not gemma:
        tok.add_special_tokens({"additional_special_tokens": qwen_tokens if qwen else ["<image>"]})
    layers = shape(dict(SMOLLM2, num_hidden_layers=4), device) | {"vocab_size": len(tok)}
    if qwen:  # (M-RoPE: a head's frequencies, a quarter by time, the rest by row and column: 8, 12, 12 of 32;
        # Qwen3-VL's interleaved, and its deepstack rows added after the first layer)
        ids = dict(zip(["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"],
                       tok.convert_tokens_to_ids(qwen_tokens)))  # fmt: skip
        text = dict(layers, bos_token_id=1, eos_token_id=2)  # (Llama's, as LLaVA's text model has them)
        half = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]) // 2
        sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                                   "mrope_section": sections, "mrope_interleaved": name == "qwen3_vl"}  # fmt: skip
        if name == "qwen3_vl":
            text["head_dim"] = 2 * half
            vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                          out_hidden_size=layers["hidden_size"], deepstack_visual_indexes=[0],
                          num_position_embeddings=16)  # fmt: skip
            config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids, bos_token_id=1, eos_token_id=2)
            pixels = Qwen2VLImageProcessor(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16)
        else:
            vision = dict(depth=2, embed_dim=64, hidden_size=layers["hidden_size"], num_heads=4, mlp_ratio=2)
            config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids, bos_token_id=1, eos_token_id=2)
            pixels = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
        processor = images_only_processor("Qwen3VLProcessor" if name == "qwen3_vl" else "Qwen2VLProcessor", pixels, tok)
    elif gemma:
        text = Gemma3TextConfig(**layers | {"head_dim": layers.get("head_dim", 64)}, sliding_window=8,
                                layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                             "full_attention"])  # fmt: skip
        vision = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=56, patch_size=14)  # fmt: skip
        ids = {k: tok.convert_tokens_to_ids(v) for k, v in specials.items()}
        config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                              boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                              image_token_index=ids["image_token"])  # fmt: skip
        processor = Gemma3Processor(Gemma3ImageProcessor(size={"height": 56, "width": 56}), tok, image_seq_length=4)
    else:
        vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=56, patch_size=14)  # fmt: skip
        config = LlavaConfig(text_config=LlamaConfig(**layers).to_dict(), vision_config=vision.to_dict(),
                             image_token_index=tok.convert_tokens_to_ids("<image>"))  # fmt: skip
        pixels = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
        processor = LlavaProcessor(pixels, tok, patch_size=14, vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1, image_token="<image>")  # fmt: skip
    path = random_checkpoint(config, root, name, torch.float32)
    for part in (processor.image_processor, processor.tokenizer) if qwen else (processor,):  # (Qwen2-VL's: no video
        part.save_pretrained(path)  # processor, which HF's save asks for)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", device=device, max_num_seqs=8, kv_cache_memory=1 << 30)
    pictures = [[Image.fromarray(np.random.RandomState(i).randint(0, 255, (60 + 20 * i, 80, 3), np.uint8))
                 for i in range(n)] for n in (1, 2)]  # fmt: skip
    prompts = [{"prompt": t, "multi_modal_data": {"image": p}} for t, p in zip(texts, pictures)] + texts[2:]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        masked = torch.isinf(b)
        a, b = a.cpu()[~masked].double(), b[~masked].double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    traced = llm.trace(prompts, list(llm.hook_names()))
    taps, patterns, equal = [], [], 0
    for t, p, got in zip(texts, pictures, traced):
        inputs = dict(processor(text=t, images=[p], return_tensors="pt"))
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask")
        ref = hf_taps(hf, ids, range(config.get_text_config().num_hidden_layers), pixels=inputs)
        for k in got:
            if k in ref:
                (patterns if k.endswith(("hook_pattern", "hook_attn_scores")) else taps).append(rel(got[k], ref[k]))
        with torch.inference_mode():
            want = hf.generate(**processor(text=t, images=[p], return_tensors="pt"), max_new_tokens=8, do_sample=False)
        params = SamplingParams(max_tokens=8, temperature=0)
        out = llm.generate({"prompt": t, "multi_modal_data": {"image": p}}, params, use_tqdm=False)[0]
        equal += want[0, len(ids) :].tolist() == out.outputs[0].token_ids
    harvested = _image_harvest(llm, name, root, texts[:2], pictures, traced)
    return {
        "trace_taps": len(taps), "trace_max_rel_err": max(taps), "pattern_max_rel_err": max(patterns),
        "greedy_equal": f"{equal}/2", "harvest_max_rel_err": harvested,
        "ok": max(taps) <= 1e-5 and max(patterns) <= 1e-4 and equal == 2 and harvested <= 1e-5,
    }  # fmt: skip


def _image_harvest(llm: LLM, name: str, root: Path, texts: list[str], pictures: list, traced: list[dict]) -> float:
    """A harvest of the image prompts as records of a text and PNG files (`image_field`): the largest relative error
    of its rows (two hooks, every row) against the trace's."""
    from safetensors.torch import load_file

    from vlens import harvest

    hooks, records = ["hook_embed", "blocks.1.hook_resid_post"], []
    for i, (text, images) in enumerate(zip(texts, pictures)):
        for j, image in enumerate(images):
            image.save(root / f"{name}-{i}-{j}.png")
        records.append({"text": text, "images": [f"{name}-{i}-{j}.png" for j in range(len(images))]})
    (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / f"{name}-harvest"
    harvest(llm, root / f"{name}.jsonl", hooks, out, context_size=256, pack=False, dtype="float32",
            image_field="images", progress=False)  # fmt: skip
    shards = [load_file(out / s["file"]) for s in json.loads((out / "manifest.json").read_text())["shards"]]
    stored = {key: torch.cat([s[key] for s in shards]) for key in shards[0]}
    worst = 0.0
    for w, want in enumerate(traced[: len(texts)]):
        at = (stored["window"] == w).nonzero().squeeze(1)
        at = at[torch.argsort(stored["position"][at])]
        for hook in hooks:
            got, ref = stored[hook][at].double(), want[hook].cpu().double()
            worst = max(worst, ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item())
    return worst


SECTIONS = {"generate": 200, "exact": 90, "profile": 45, "harvest": 60, "hooked": 60, "gemma4": 60,
            "qwen3_5": 60, "bamba": 60, "mamba": 60, "nemotron_h": 60, "falcon_h1": 60, "deepseek": 60,
            "llama4": 60, "images": 60, "lora": 90, "sampling": 45}  # fmt: skip


def _version(package: str) -> str | None:
    """The installed version of `package`, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="gpu_suite.json")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test over narrow layers")
    args = ap.parse_args(argv)
    wanted = args.sections.split(",")
    if unknown := set(wanted) - set(SECTIONS):
        ap.error(f"--sections: {', '.join(sorted(unknown))} not among {', '.join(SECTIONS)}")
    device = args.device
    assert device == "cpu" or torch.cuda.is_available(), "gpu_suite.py needs a CUDA GPU (or --device cpu)"
    rows: dict = {
        "device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__, "transformers": transformers.__version__, "triton": _version("triton"),
    }  # fmt: skip
    guard, root = Guard(Path(args.out), rows), Path(tempfile.mkdtemp())
    quick = args.quick or device == "cpu"
    slower = 1 if device == "cuda" else 3  # the time guards' (a profiled CPU decode run takes ~40 s)
    config = LlamaConfig(**shape(LLAMA_1B, device))
    llama = random_checkpoint(config, root, "llama-3.2-1b-shape", torch.bfloat16, device)
    if "exact" in wanted:  # first: a run cut short still says whether the numbers are right
        guard.run("exact", SECTIONS["exact"] * slower, exactness, root, quick, device)
    if "generate" in wanted:
        guard.run("generate", SECTIONS["generate"] * slower, generation, llama, quick, device)
    for name, fn in (("profile", profile), ("harvest", harvesting)):
        if name in wanted:
            guard.run(name, SECTIONS[name] * slower, fn, llama, quick, device)
    for name, fn in (("sampling", sampling), ("hooked", hooked), ("gemma4", gemma4), ("qwen3_5", qwen3_5),
                     ("bamba", bamba), ("mamba", mamba), ("nemotron_h", nemotron_h), ("falcon_h1", falcon_h1),
                     ("deepseek", deepseek), ("llama4", llama4), ("images", images), ("lora", lora)):
        if name in wanted:
            guard.run(name, SECTIONS[name] * slower, fn, root, quick, device)
    print(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
