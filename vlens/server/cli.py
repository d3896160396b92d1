"""The `vlens serve` subcommand (registered by vlens.cli through `add_parser`).

Its flags are the fields of `ServerConfig` and, in the engine group, of `EngineConfig`; the web stack is
imported only when the command runs, so other subcommands start as fast as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from vlens.engine.config import EngineConfig
from vlens.lora_files import CONFIG as ADAPTER_CONFIG
from vlens.server.config import API_KEY_ENV, ServerConfig, split_named_file
from vlens.settings import add_flags, from_args, values

# Settings both configs have, which the server's flags give: capture stays off unless the operator asks.
SHARED = {f.name for f in dataclasses.fields(ServerConfig)} & {f.name for f in dataclasses.fields(EngineConfig)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (with opt-in activation capture)",
        description="Serve /v1/completions and /v1/chat/completions (streaming too), /v1/embeddings, /v1/models, "
        "/v1/hooks, /v1/activations/{id}, /tokenize, /detokenize, /tokenizer_info, /metrics, /health, and /lens (a "
        "page showing the logit lens, attention, SAE features and steering for a prompt). Requests "
        "capture activations through the `vlens` extension field only if the server runs with --enable-capture.",
    )
    add_flags(p, ServerConfig)
    add_flags(p.add_argument_group("engine"), EngineConfig, skip=SHARED)
    p.set_defaults(func=run_serve)


def lora_settings(specs: tuple[str, ...] | None, args: argparse.Namespace) -> dict:
    """The engine settings `--lora-modules` needs: enable_lora, slots for every adapter at once (a request never waits
    on another adapter's) and the largest adapter's rank, at least as the flags give them."""
    if not specs:
        return {}
    files = [Path(split_named_file(spec)[1]).expanduser() / ADAPTER_CONFIG for spec in specs]
    ranks = [json.loads(f.read_text()).get("r", 0) for f in files if f.is_file()]  # (a missing one: create_app's error)
    return {"enable_lora": True, "max_loras": max(args.max_loras, len(specs)),
            "max_lora_rank": max([args.max_lora_rank, *ranks])}


def run_serve(args: argparse.Namespace) -> int:
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    config = from_args(ServerConfig, args, api_key=api_key)
    # The server refuses capture in requests unless --enable-capture; its engine always can, for /v1/embeddings;
    # and it runs LoRA adapters where --lora-modules names some, all of them at once (lora_settings).
    loras = lora_settings(config.lora_modules, args) or ({"enable_lora": True} if config.allow_runtime_lora_updating
                                                         else {})  # fmt: skip
    engine = from_args(EngineConfig, args, enable_capture=True, **loras)
    from vlens.llm import LLM  # only once the settings are known to be good
    from vlens.server.app import serve

    return serve(LLM(**values(engine)), config)
