"""The `vlens serve` subcommand (registered by vlens.cli through `add_parser`).

The web stack is imported only when the command runs, so other subcommands start as fast as before.
"""

from __future__ import annotations

import argparse
import os

from vlens.loader import DEFAULT_MODEL, DTYPES

API_KEY_ENV = "VLENS_API_KEY"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (with opt-in activation capture)",
        description="Serve /v1/completions and /v1/chat/completions (streaming too), /v1/models, /v1/hooks, "
        "/v1/activations/{id}, /metrics and /health. Requests capture activations through the `vlens` "
        "extension field only if the server runs with --enable-capture.",
    )
    p.add_argument("--model", help=f"HF checkpoint directory, .gguf file or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--enable-capture", action="store_true", help="allow requests to capture activations")
    p.add_argument(
        "--max-capture-bytes",
        type=int,
        default=256 << 20,
        help="refuse requests whose capture could exceed this many bytes (default: 256 MiB)",
    )
    p.add_argument(
        "--inline-activation-bytes",
        type=int,
        default=1 << 20,
        help="activations up to this size come inline as base64, larger ones as a download handle (default: 1 MiB)",
    )
    p.add_argument(
        "--activation-ttl",
        type=float,
        default=600.0,
        help="seconds an undownloaded activation handle is kept (default: 600)",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default: 4 MiB)")
    p.add_argument(
        "--api-key",
        help=f"require `Authorization: Bearer KEY` on every route but /health "
        f"(default: the environment variable {API_KEY_ENV}, else no authentication)",
    )
    engine = p.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", help=f"auto (bfloat16 on CUDA, else float32), {', '.join(DTYPES)}")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    engine.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch (default: 256)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=4096, help="most tokens per step (default: 4096)")
    engine.add_argument("--max-model-len", type=int, help="longest sequence, prompt plus output (default: the model's)")
    engine.add_argument(
        "--kv-cache-memory",
        type=int,
        help="bytes for the KV cache (default: 80%% of free GPU memory, or up to 2 GiB on CPU)",
    )
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from vlens.llm import LLM
    from vlens.server.app import serve
    from vlens.server.config import ServerConfig

    config = ServerConfig(
        host=args.host,
        port=args.port,
        enable_capture=args.enable_capture,
        max_capture_bytes=args.max_capture_bytes,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        served_model_name=args.served_model_name,
        inline_activation_bytes=args.inline_activation_bytes,
        activation_ttl_s=args.activation_ttl,
        max_body_bytes=args.max_body_bytes,
    )
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        enable_capture=args.enable_capture,
    )
    serve(llm, config)
    return 0
