"""The `vlens harvest` and `vlens export` subcommands (registered by vlens.cli through `add_parser`)."""

from __future__ import annotations

import argparse

from vlens.harvest.export import EXPORT_DTYPES, FORMATS, export
from vlens.harvest.run import harvest
from vlens.loader import DTYPES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `harvest` and `export`; each sets `func(args) -> int` on the parsed namespace."""
    p = subparsers.add_parser(
        "harvest",
        help="run a model over a corpus and store hook activations as safetensors shards",
        description="Store the activations of one or more hooks over a corpus, resumably: re-running the same "
        "command after a kill continues after the last complete shard.",
    )
    p.add_argument("--model", default=None, help="checkpoint directory, hub id or .gguf (default: SmolLM2-135M)")
    p.add_argument("--source", required=True, help=".txt, .jsonl, .parquet, a datasets directory or a hub dataset id")
    p.add_argument("--hooks", nargs="+", required=True, help="hook names or globs (see `vlens hooks`)")
    p.add_argument("--out", required=True, help="output directory or fsspec URL (new, empty, or a run to resume)")
    p.add_argument("--context-size", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="stored dtype (default bfloat16)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens (default: all)")
    p.add_argument("--shard-bytes", type=int, default=2**30, help="bytes per shard, about (default 1 GiB)")
    p.add_argument("--no-bos", action="store_true", help="no BOS at the start of windows")
    p.add_argument("--keep-bos", action="store_true", help="store the rows at BOS tokens too")
    p.add_argument("--no-pack", action="store_true", help="one document per window, truncated")
    p.add_argument("--text-field", default="text", help="column with the text or token ids (default text)")
    p.add_argument("--whole-file", action="store_true", help="a .txt source is one document, not one per line")
    p.add_argument("--split", default="train", help="split of a datasets directory or hub dataset (default train)")
    p.add_argument("--exclude-token-ids", type=int, nargs="+", default=None, help="leave out rows at these tokens")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per forward (default: 4096 CPU, 32768 GPU)")
    p.add_argument("--seed", type=int, default=None, help="shuffle rows within each shard with this seed")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--model-dtype", default="auto", help="dtype of the forward (default: float32 CPU, bfloat16 GPU)")
    p.add_argument("--ray", action="store_true", help="run the forwards on a Ray actor pool (pip install vlens[ray])")
    p.add_argument("--workers", type=int, default=1, help="Ray actors, one GPU each on CUDA (default 1)")
    p.add_argument(
        "--cpus-per-worker", type=float, default=1, help="CPUs each Ray actor holds without a GPU (default 1)"
    )
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: running one, else local)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=run_harvest)

    e = subparsers.add_parser(
        "export",
        help="convert a harvest for other tools",
        description="Write a finished harvest as the Hugging Face datasets layout SAELens reads cached "
        "activations from (one row per window).",
    )
    e.add_argument("out_dir", help="a harvest directory")
    e.add_argument("--format", required=True, choices=list(FORMATS))
    e.add_argument("--to", required=True, help="target directory (new or empty)")
    e.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES), help="stored dtype (default float32)")
    e.set_defaults(func=run_export)


def run_harvest(args: argparse.Namespace) -> int:
    harvest(  # prints its progress bar and summary line on stderr unless --quiet
        args.model,
        args.source,
        args.hooks,
        args.out,
        context_size=args.context_size,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        shard_bytes=args.shard_bytes,
        prepend_bos=not args.no_bos,
        pack=not args.no_pack,
        text_field=args.text_field,
        exclude_token_ids=args.exclude_token_ids,
        exclude_bos=not args.keep_bos,
        whole_file=args.whole_file,
        split=args.split,
        batch_tokens=args.batch_tokens,
        seed=args.seed,
        device=args.device,
        model_dtype=args.model_dtype,
        progress=not args.quiet,
        backend="ray" if args.ray else "local",
        workers=args.workers,
        cpus_per_worker=args.cpus_per_worker,
        ray_address=args.ray_address,
    )
    return 0


def run_export(args: argparse.Namespace) -> int:
    target = export(args.out_dir, args.to, format=args.format, dtype=args.dtype)
    print(f"export: {args.out_dir} -> {target} ({args.format})")
    return 0
