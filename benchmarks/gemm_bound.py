"""The floor under any exact engine on this CPU: the time Hugging Face spends in float32 GEMMs.

    .venv/bin/python benchmarks/gemm_bound.py [--prompts 64] [--tokens 64] [--windows 64]

vlens matches HF to 1e-5 relative error, and on SmolLM2 that holds only with the very GEMM kernel
HF runs (torch's MKL sgemm): a kernel that sums in another order (oneDNN with prepacked weights,
measured below) moves the deeper layers' activations past 1e-5. So HF's GEMM time is a floor for
vlens as well, and `HF time / HF GEMM time` bounds the speed-up any exact engine can reach over HF
on the same batch. This script measures that bound for the workloads of bench_generate.py (64
prompts x 64 new tokens, greedy) and bench_harvest.py (context 128, HF's forward stopped by a hook
after layer 15 against vlens.harvest, both writing bfloat16 rows to disk), and prints vlens's own
time and GEMM time beside it.

GEMM time is the self CPU time of aten::addmm / mm / bmm under torch.profiler (accurate for ops this
large); the wall times are measured without the profiler. The last table times one decode-sized and
one prefill-sized GEMM of SmolLM2's MLP with MKL (what torch.nn.functional.linear runs) and with
oneDNN prepacked weights, and the difference of their results.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from bench_generate import prompts
from bench_harvest import CONTEXT, HOOK, bench_windows, corpus, hf_hook_stop
from transformers import AutoModelForCausalLM, AutoTokenizer

from vlens import LLM, SamplingParams, harvest
from vlens.loader import cache_dir, resolve_model_path

GEMMS = ("aten::addmm", "aten::mm", "aten::bmm")


def timed(fn) -> tuple[float, float]:
    """(wall seconds without the profiler, GEMM self seconds with it), after a warm-up."""
    fn()
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    gemm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMMS) / 1e6
    return wall, gemm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--windows", type=int, default=64, help="harvest windows of 128 tokens, 32 per forward")
    args = ap.parse_args()
    path = resolve_model_path(None)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    texts = prompts(args.prompts)
    batch = tok(texts, return_tensors="pt", padding=True)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    source = corpus()
    ids = bench_windows(llm, source, args.windows)

    def hf_generate() -> None:
        with torch.inference_mode():
            hf.generate(**batch, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                        pad_token_id=tok.pad_token_id)  # fmt: skip

    scratch = Path(tempfile.mkdtemp(dir=cache_dir()))
    runs = iter(range(1 << 30))

    def fresh() -> Path:
        out = scratch / str(next(runs))
        out.mkdir()
        return out

    def vlens_harvest() -> None:
        harvest(llm, source, HOOK, fresh() / "out", context_size=CONTEXT, max_tokens=len(ids) * CONTEXT,
                batch_tokens=32 * CONTEXT, progress=False)  # fmt: skip

    rows = {
        f"generate {args.prompts}x{args.tokens}": (timed(hf_generate), timed(lambda: llm.generate(texts, params, use_tqdm=False))),
        f"harvest layer 15, {args.windows}x{CONTEXT}": (
            timed(lambda: hf_hook_stop(hf, ids, fresh(), 32)), timed(vlens_harvest)
        ),
    }  # fmt: skip
    shutil.rmtree(scratch)
    print(f"\n{torch.get_num_threads()} torch threads; seconds (GEMM seconds in brackets)")
    print(f"{'workload':<32} {'HF':>14} {'vlens':>14} {'HF/vlens':>9} {'bound: HF/HF GEMM':>18}")
    for name, ((hf_wall, hf_gemm), (v_wall, v_gemm)) in rows.items():
        print(
            f"{name:<32} {hf_wall:6.2f} ({hf_gemm:5.2f}) {v_wall:6.2f} ({v_gemm:5.2f}) {hf_wall / v_wall:8.2f}x "
            f"{hf_wall / hf_gemm:17.2f}x"
        )

    print(f"\n{'GEMM (SmolLM2 MLP up, float32)':<32} {'MKL ms':>8} {'oneDNN ms':>10} {'speed-up':>9} {'rel. diff':>10}")
    w = hf.model.layers[0].mlp.up_proj.weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    for m in (64, 4096):
        x = torch.randn(m, w.shape[1])
        mkl = torch.nn.functional.linear(x, w)
        onednn = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        t_mkl = min_time(lambda x=x: torch.nn.functional.linear(x, w))
        t_dnn = min_time(lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        diff = ((mkl - onednn).double().norm() / mkl.double().norm()).item()
        print(f"{f'{m} rows x {w.shape[1]} -> {w.shape[0]}':<32} {t_mkl * 1e3:8.2f} {t_dnn * 1e3:10.2f} "
              f"{t_mkl / t_dnn:8.2f}x {diff:10.1e}")  # fmt: skip


def min_time(fn, repeats: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    main()
