"""Benchmark: the Ray backend of vlens.harvest (1 and 2 CPU actors) against the single-process harvest.

Same data for every run: the first `--tokens` tokens of the Shakespeare corpus of bench_harvest.py
(fetched there once), SmolLM2-135M in float32, `blocks.15.hook_resid_post` stored as bfloat16,
context 128, about 8 shards. Each run writes a fresh directory; the Ray runs are checked to be
byte-identical to the single-process one. Then each runs over a single window, which measures its
fixed start-up cost.

Times are end to end of the `harvest` call: the Ray runs include starting the actors and loading one
model per actor and one on the driver (the cluster itself is started before, as on a real cluster).
The single process uses torch's default threads (all cores); each CPU actor gets one core (Ray sets
its OMP_NUM_THREADS to 1), so on a 2-core machine 2 actors use the same cores as the single process.

The runs go in rounds, in rotated order, and ratios are medians of per-round ratios, so that the
drifting load of a shared machine cancels out.

Run:  .venv/bin/python benchmarks/bench_harvest_ray.py [--tokens 16384] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from bench_harvest import CONTEXT, HOOK, corpus

from vlens import harvest
from vlens.loader import cache_dir, resolve_model_path

ROW_BYTES = 576 * 2 + 20  # SmolLM2's d_model in bfloat16 + token id, window and position


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16_384, help="tokens per run (default 16,384)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all three runs, rotated (default 3)")
    args = parser.parse_args()
    source, model = corpus(), str(resolve_model_path(None))
    options = {
        "context_size": CONTEXT, "max_tokens": args.tokens, "shard_bytes": args.tokens // 8 * ROW_BYTES,
        "model_dtype": "float32", "device": "cpu", "progress": False,
    }  # fmt: skip
    print(f"{args.tokens:,} tokens of {source.name} per run, {HOOK} as bfloat16, "
          f"{torch.get_num_threads()} torch threads, {args.rounds} rounds")  # fmt: skip
    started = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"ray.init (local cluster, 2 CPUs): {time.perf_counter() - started:.1f} s (not in the times below)")
    runs = {"single process": {}, "ray, 1 actor": {"backend": "ray", "workers": 1},
            "ray, 2 actors": {"backend": "ray", "workers": 2}}  # fmt: skip
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        reference = None
        for r in range(args.rounds):
            names = list(runs)[r % 3 :] + list(runs)[: r % 3]  # rotated: drifting load hits every run
            for name in names:
                out = Path(tmp) / f"{r}-{name.replace(' ', '_').replace(',', '')}"
                summary = harvest(model, source, HOOK, out, **options, **runs[name])
                seconds[name].append(summary.seconds)
                files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
                reference = reference or files
                same = "identical" if files == reference else "DIFFERENT"
                print(f"round {r} {name:15s} {summary.seconds:6.1f} s  {args.tokens / summary.seconds:8,.0f} tokens/s"
                      f"  {summary.shards} shards, files {same}", flush=True)  # fmt: skip
        for name, backend in runs.items():  # fixed cost: the same run over a single window
            out = Path(tmp) / ("one-" + name.replace(" ", "_").replace(",", ""))
            summary = harvest(model, source, HOOK, out, **{**options, "max_tokens": CONTEXT}, **backend)
            print(f"{name:15s} one window: {summary.seconds:5.1f} s (start-up: model loads, actors)", flush=True)
    ray.shutdown()
    print("medians:")
    for name in runs:
        print(f"  {name:15s} {args.tokens / statistics.median(seconds[name]):8,.0f} tokens/s")
    for name, base in (("ray, 1 actor", "single process"), ("ray, 2 actors", "single process"),
                       ("ray, 2 actors", "ray, 1 actor")):  # fmt: skip
        ratio = statistics.median(b / n for n, b in zip(seconds[name], seconds[base]))
        print(f"  {name} / {base}: {ratio:.2f}x (median of per-round ratios)")


if __name__ == "__main__":
    main()
