"""The `vlens harvest` and `vlens export` subcommands (registered by vlens.cli through `add_parser`)."""

from __future__ import annotations

import argparse

from vlens.harvest.config import HarvestConfig
from vlens.harvest.export import EXPORT_DTYPES, FORMATS, export
from vlens.harvest.run import harvest_with
from vlens.settings import add_flags, from_args

HARVEST_ABOUT = (
    "Store the activations of one or more hooks over a corpus, resumably: re-running the same command after a kill "
    "continues after the last complete shard."
)
EXPORT_ABOUT = (
    "Write a finished harvest as the Hugging Face datasets layout SAELens reads cached activations from (one row "
    "per window)."
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `harvest` and `export`; each sets `func(args) -> int` on the parsed namespace."""
    p = subparsers.add_parser(
        "harvest", help="run a model over a corpus and store hook activations as safetensors shards",
        description=HARVEST_ABOUT,
    )  # fmt: skip
    add_flags(p, HarvestConfig)
    p.set_defaults(func=run_harvest)

    e = subparsers.add_parser("export", help="convert a harvest for other tools", description=EXPORT_ABOUT)
    e.add_argument("out_dir", help="a harvest directory")
    e.add_argument("--format", required=True, choices=list(FORMATS))
    e.add_argument("--to", required=True, help="target directory (new or empty)")
    e.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES), help="stored dtype (default float32)")
    e.set_defaults(func=run_export)


def run_harvest(args: argparse.Namespace) -> int:
    harvest_with(from_args(HarvestConfig, args))  # prints its progress bar and summary line on stderr unless --quiet
    return 0


def run_export(args: argparse.Namespace) -> int:
    target = export(args.out_dir, args.to, format=args.format, dtype=args.dtype)
    print(f"export: {args.out_dir} -> {target} ({args.format})")
    return 0
