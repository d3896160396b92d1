"""Benchmark: `vlens.harvest` on one CUDA GPU against Hugging Face forwards doing the same job, and its
model FLOPs utilisation. Needs a GPU; downloads nothing.

Model: random bf16 weights with the config of Llama-3.2-1B (benchmarks/gpu_suite.py's), made here.
Work: one layer (`blocks.8.hook_resid_post`, HF's hidden_states[9]) of `--windows` windows of 1024 random
token ids, every row brought to host memory:
  vlens            vlens.harvest to disk: tokens per forward from the memory probe, pipelined; once with
                   the default 1 GiB shards and once with 256 MiB shards (a long harvest's steady state:
                   writes overlap the forwards), and once with --pipeline off (same bytes, checked)
  trace            LLM.trace of the same windows (rows to host memory, no disk)
  HF hook-stop     AutoModelForCausalLM with a forward hook after layer 8 that copies the layer's output
                   to the CPU and raises to stop the forward, at its best batch of 8, 16, 32, 64 windows
  HF all-hidden    output_hidden_states=True, hidden_states[9] to the CPU, at its best batch of 8, 16, 32
Model FLOPs utilisation counts the layers run only (0..8): 2 x their parameters per token plus causal
attention (2 x layers x context x d_model per token), over the bf16 matmul peak measured here (8192^3).
Targets (issue 26): >= 2x HF hook-stop, >= 3x HF all-hidden, >= 45% MFU.

Run:  .venv/bin/python benchmarks/bench_harvest_gpu.py [--windows 192] [--out harvest_gpu.json]
`measure(path, windows, device)` is what benchmarks/gpu_suite.py's harvest row calls (`--device cpu`: the
same steps on the CPU, with a peak from a smaller matmul).
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
from gpu_suite import sync  # (benchmarks/ is on the path: this script's folder, or gpu_suite's harvest row)

CONTEXT = 1024
LAYER = 8
HOOK = f"blocks.{LAYER}.hook_resid_post"


def timed(fn) -> float:
    """Seconds of the second of two calls (the first warms the allocator, kernels and hashes)."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bf16_peak_flops(device: str) -> float:
    n = 8192 if device == "cuda" else 512  # (on the CPU, a smoke test's)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    seconds = timed(lambda: [a @ b for _ in range(20)])
    return 20 * 2 * n**3 / seconds


def measure(path: str, windows: int, device: str = "cuda") -> dict:
    """Every number of the harvest row, for the checkpoint at `path` (a Llama-shaped model, bf16)."""
    import vlens
    from vlens import LLM
    from vlens.loader import load_model

    rng = random.Random(1)
    ids = [[rng.randrange(1000, 100000) for _ in range(CONTEXT)] for _ in range(windows)]
    root = Path(tempfile.mkdtemp())
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"tokens": w}) for w in ids))
    tokens = windows * CONTEXT
    peak = bf16_peak_flops(device)
    loaded = load_model(path, dtype="bfloat16", device=device)  # no KV cache: the batches get the memory
    hidden = loaded.config.hidden_size
    run_params = sum(p.numel() for p in loaded.model.layers[: LAYER + 1].parameters())
    flops = tokens * (2 * run_params + 2 * (LAYER + 1) * CONTEXT * hidden)
    out: dict = {"tokens": tokens, "peak_tflops": peak / 1e12}
    runs: list[Path] = []

    def harvest(**options):
        runs.append(root / f"run{len(runs)}")
        summary = vlens.harvest(loaded, str(corpus), HOOK, str(runs[-1]), context_size=CONTEXT, text_field="tokens",
                                prepend_bos=False, progress=False, **options)  # fmt: skip
        out["summary"] = str(summary)

    for label, options in (("vlens", {}), ("vlens_256M", {"shard_bytes": 1 << 28}),
                           ("vlens_256M_serial", {"shard_bytes": 1 << 28, "pipeline": "off"})):  # fmt: skip
        out[label] = timed(lambda: harvest(**options))  # noqa: B023 - called at once
        out[f"{label}_summary"] = out.pop("summary")
    out["serial_same_bytes"] = _files(runs[-1]) == _files(runs[-3])
    loaded = None
    torch.cuda.empty_cache()
    llm = LLM(path, dtype="bfloat16", device=device, max_num_batched_tokens=16 * CONTEXT)
    out["trace"] = timed(lambda: llm.trace(ids, HOOK))
    llm = None
    torch.cuda.empty_cache()

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    out["hf_hook_stop"] = {b: timed(lambda: _hf_hook_stop(hf, ids, b)) for b in (8, 16, 32, 64)}  # noqa: B023
    out["hf_all_hidden"] = {b: timed(lambda: _hf_all_hidden(hf, ids, b)) for b in (8, 16, 32)}  # noqa: B023
    best = out["vlens_256M"]
    out.update(
        tok_s=tokens / best, mfu=flops / best / peak, mfu_1GiB_shards=flops / out["vlens"] / peak,
        vs_hf_stopped=min(out["hf_hook_stop"].values()) / best,
        vs_hf_hidden_states=min(out["hf_all_hidden"].values()) / best, vs_trace=best / out["trace"],
    )  # fmt: skip
    return out


class _Stop(Exception):
    """Raised by the hook after the layer: HF's forward goes no further, as a harvest needs."""


def _hf_hook_stop(hf, ids: list[list[int]], batch: int) -> None:
    def keep(module, args, output):
        (output[0] if isinstance(output, tuple) else output).cpu()
        raise _Stop

    handle = hf.model.layers[LAYER].register_forward_hook(keep)
    try:
        for start in range(0, len(ids), batch):
            with torch.inference_mode(), contextlib.suppress(_Stop):
                hf(torch.tensor(ids[start : start + batch], device=hf.device), use_cache=False)
    finally:
        handle.remove()


def _hf_all_hidden(hf, ids: list[list[int]], batch: int) -> None:
    for start in range(0, len(ids), batch):
        with torch.inference_mode():
            batch_ids = torch.tensor(ids[start : start + batch], device=hf.device)
            hf(batch_ids, use_cache=False, output_hidden_states=True).hidden_states[LAYER + 1].cpu()


def _files(out_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=192, help="windows of 1024 tokens (default 192)")
    parser.add_argument("--out", default="harvest_gpu.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bench_harvest_gpu.py needs a CUDA GPU"
    from gpu_suite import LLAMA_1B, random_checkpoint
    from transformers import LlamaConfig

    root = Path(tempfile.mkdtemp())
    path = random_checkpoint(LlamaConfig(**LLAMA_1B), root, "llama-3.2-1b-shape", torch.bfloat16, "cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **measure(path, args.windows)}
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"{result['gpu']}, torch {result['torch']}; {result['tokens']:,} tokens, bf16 peak "
          f"{result['peak_tflops']:.0f} TFLOP/s")  # fmt: skip
    for label in ("vlens", "vlens_256M", "vlens_256M_serial", "trace"):
        print(f"{label:<20}{result[label]:8.3f} s  {result['tokens'] / result[label]:12,.0f} tokens/s")
    for label in ("hf_hook_stop", "hf_all_hidden"):
        print(f"{label:<20}" + ", ".join(f"batch {b}: {s:.3f} s" for b, s in result[label].items()))
    print(
        f"\nvlens (256 MiB shards) vs HF hook-stop at its best batch: {result['vs_hf_stopped']:.2f}x (target >= 2)\n"
        f"vlens vs HF output_hidden_states at its best batch:     {result['vs_hf_hidden_states']:.2f}x (target >= 3)\n"
        f"model FLOPs utilisation: {result['mfu']:.1%} (1 GiB shards {result['mfu_1GiB_shards']:.1%}; target >= 45%)\n"
        f"harvest / trace time: {result['vs_trace']:.2f}; pipelined and serial files equal: "
        f"{result['serial_same_bytes']}\n{result['vlens_256M_summary']}"
    )


if __name__ == "__main__":
    main()
