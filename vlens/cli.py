"""The `vlens` command: one `_cmd_<name>(args) -> int` per subcommand, all registered in `_parser()`
(subcommands that live with their feature, like harvest and export, register through its `add_parser`).

A ValueError from vlens (a bad hook, dtype, device, text or model) ends the command with one line
`vlens: error: ...` on stderr and exit status 2, as argparse does for malformed arguments; Ctrl-C ends it
with `vlens: interrupted` and status 130.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from vlens.capture import Capture, Positions, TunedLens
from vlens.capture.names import hook_shapes, is_pattern
from vlens.capture.rows import widen
from vlens.config import ModelConfig
from vlens.engine.config import EngineConfig
from vlens.harvest import cli as harvest_cli
from vlens.harvest.dataset import difference_of_means
from vlens.images import load_image
from vlens.inputs import ImagePrompt, to_token_lists
from vlens.llm import LLM
from vlens.loader import model_config
from vlens.sae.model import SAE
from vlens.sampling_params import SamplingParams
from vlens.server import cli as server_cli
from vlens.settings import add_flags, from_args, values
from vlens.steering import AGGREGATORS, SteeringVector, train_steering_vector

MODEL_FLAGS = {"model", "revision", "hf_overrides"}  # what names the model, in every command that loads one
TRACE_ABOUT = "Run the texts through the model and print, per text, each hook's shape, dtype and mean row norm."
TRACE_FILE = (
    "--out writes one safetensors file with the texts packed back to back, one row per token: a tensor "
    "per hook, keyed by the hook name, [rows, *per-token shape]; token_ids, sequence (index of the text) "
    "and position (within its text), each [rows] int64; metadata 'model', 'texts' (a JSON list) and, with --image, "
    "'images' (their files, a JSON list). Text i's rows of a hook are acts[hook][acts['sequence'] == i]; with "
    "--image its image tokens' rows are among them (the placeholders expanded, token_ids says which)."
)
GENERATE_ABOUT = (
    "Generate a completion per prompt (greedy unless --temperature) and print a table of the captured tensors."
)
GENERATE_FILE = (
    "--out writes one safetensors file: for prompt i, '{i}/{hook}' [rows, ...] (with --sae '{i}/{hook}.sae_ids' "
    "int32 and '{i}/{hook}.sae_values', [rows, top_k]), '{i}/positions' (the sequence position of each row) and "
    "'{i}/token_ids' (prompt then completion); metadata holds the prompts and completions."
)
STEERING_ABOUT = (
    "Train a steering vector from contrastive pairs (vlens.steering.train_steering_vector), or take the difference "
    "of the mean rows of two harvests (--from-harvests; vlens.harvest.difference_of_means), and write it as a "
    "safetensors file, one vector per hook, which `vlens generate --steering-vector`, `vlens harvest "
    "--steering-vector` and `vlens serve --steering-vector NAME=PATH` read."
)
STEERING_PAIRS = 'PAIRS is a JSON-lines file, one pair a line: {"positive": "...", "negative": "..."}.'
LENS_ABOUT = (
    "Run a prompt (greedy, optionally generating first) and write what `vlens serve`'s /lens page shows for it as "
    "one self-contained HTML file, which opens offline: the tokens, the logit lens at every layer (top token and "
    "probability; top-k on hover or focus), every layer's attention patterns, and with --sae the top SAE latents."
)


def _cmd_hooks(args: argparse.Namespace) -> int:
    # Only the config is read: listing the hooks of a large model should not load its weights.
    shapes = hook_shapes(_model_config(args))
    width = max(map(len, shapes))
    for name, shape in shapes.items():
        print(f"{name:<{width}}  {shape}")
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    _check_out(args.out)
    images = [load_image(path, "--image", local_files=True) for path in args.image or []]
    llm = _llm(args)  # after the images are known to be good
    if images:  # (each text's token ids with its images' placeholders expanded: the processor's, no tower)
        encoder = llm.image_encoder("--image")
        token_lists = [encoder.prepare(ImagePrompt(text, images), "--image").ids.tolist() for text in args.texts]
        results = llm.trace([{"prompt": text, "multi_modal_data": {"image": images}} for text in args.texts],
                            args.hooks)  # fmt: skip
    else:
        token_lists = to_token_lists(args.texts, llm.tokenizer, llm.config.vocab_size, field="texts")
        results = llm.trace(token_lists, args.hooks)
    for i, (text, ids, acts) in enumerate(zip(args.texts, token_lists, results)):
        print(f"text {i}: {text!r} ({len(ids)} token{'s' * (len(ids) != 1)})")
        rows = [("hook", "shape", "dtype", "mean row norm")]
        for name, t in acts.items():
            norm = t.flatten(1).double().norm(dim=1).mean().item()
            rows.append((name, str(tuple(t.shape)), str(t.dtype).removeprefix("torch."), f"{norm:.4f}"))
        _print_table(rows)
    if args.out:
        width = max(map(len, token_lists))  # attention patterns: every text's rows as wide as the longest text
        tensors = {
            name: torch.cat([widen(name, acts[name], width) if is_pattern(name) else acts[name] for acts in results])
            for name in results[0]
        }
        tensors["token_ids"] = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64)
        tensors["sequence"] = torch.cat([torch.full((len(ids),), i) for i, ids in enumerate(token_lists)])
        tensors["position"] = torch.cat([torch.arange(len(ids)) for ids in token_lists])
        metadata = {"model": llm.model_name, "texts": json.dumps(args.texts)}
        save_file(tensors, args.out, metadata=metadata | ({"images": json.dumps(args.image)} if images else {}))
        print(f"wrote {args.out}: {len(results[0])} hooks, {len(tensors['token_ids'])} rows")
    return 0


def _generate_capture(args: argparse.Namespace) -> Capture | None:
    """--capture's hooks, or --sae's top latents (by default at the generated rows), at --positions."""
    if args.sae is None:
        positions = Positions.parse(args.positions or "all", "--positions")
        return Capture(hooks=args.capture, positions=positions) if args.capture else None
    if args.capture:
        raise ValueError("--capture: give --capture or --sae, not both (a request has one capture)")
    sae = SAE.load(args.sae, hook=args.sae_hook)
    return Capture(sae=sae, top_k=args.top_k, positions=Positions.parse(args.positions or "generated", "--positions"))


def _cmd_generate(args: argparse.Namespace) -> int:
    _check_out(args.out)
    capture = _generate_capture(args)  # an unreadable SAE fails before the model loads
    if args.out and capture is None:
        raise ValueError("--out: give --capture or --sae too; the file holds the rows they capture")
    steers = []
    if args.steering_vector is not None:  # (read before the model loads: a bad file fails at once)
        steers = SteeringVector.load(args.steering_vector).steers(args.multiplier)
    elif args.multiplier != 1.0:
        raise ValueError("--multiplier: scales --steering-vector; give one")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, capture=capture, seed=args.seed,
                            interventions=steers)  # fmt: skip
    images = [load_image(path, "--image", local_files=True) for path in args.image or []]
    llm = _llm(args)  # after the sampling flags and the images are known to be good
    run = llm.chat if args.chat else llm.generate
    if args.chat:
        parts = [{"type": "image_pil", "image_pil": image} for image in images]
        prompts = [[{"role": "user", "content": [*parts, {"type": "text", "text": p}] if parts else p}]
                   for p in args.prompts]  # fmt: skip
    else:
        prompts = [{"prompt": p, "multi_modal_data": {"image": images}} if images else p for p in args.prompts]
    outputs = run(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        print(f"prompt {i}: {args.prompts[i]!r} ({len(out.prompt_token_ids)} tokens)")
        print(f"completion ({len(completion.token_ids)} tokens, {completion.finish_reason}): {completion.text!r}")
        if out.activations:
            rows = [("hook", "shape", "dtype", "mean row norm")]
            for name, t in out.activations.items():
                norm = t.flatten(1).double().norm(dim=1).mean().item() if len(t) else float("nan")
                rows.append((name, str(tuple(t.shape)), str(t.dtype).removeprefix("torch."), f"{norm:.4f}"))
            _print_table(rows)
            print(f"  positions: {out.activation_positions.tolist()}")
        for hook, (ids, acts) in out.sae_features.items():
            _print_features(llm.tokenizer, out, hook, ids, acts)
    if args.out:
        tensors = {f"{i}/{name}": t.contiguous() for i, out in enumerate(outputs) for name, t in out.activations.items()}
        for i, out in enumerate(outputs):
            for name, (ids, values) in out.sae_features.items():
                tensors.update({f"{i}/{name}.sae_ids": ids, f"{i}/{name}.sae_values": values})
        tensors.update({f"{i}/positions": out.activation_positions for i, out in enumerate(outputs)})
        tensors.update(
            {f"{i}/token_ids": torch.tensor(out.prompt_token_ids + out.outputs[0].token_ids) for i, out in enumerate(outputs)}
        )
        texts = [out.outputs[0].text for out in outputs]
        save_file(tensors, args.out, metadata={"model": llm.model_name, "prompts": json.dumps(args.prompts), "completions": json.dumps(texts)})
        print(f"wrote {args.out}: {len(tensors)} tensors")
    return 0


def _cmd_steering_vector(args: argparse.Namespace) -> int:
    if (args.pairs is None) == (args.from_harvests is None):
        raise ValueError("pairs: give PAIRS (a JSON-lines file of contrastive pairs) or --from-harvests POS NEG")
    _check_out(args.out)
    if args.from_harvests is not None:
        vector = difference_of_means(*args.from_harvests, args.hooks)
        source = "the mean rows of " + " minus ".join(args.from_harvests)
    else:
        if args.hooks is None:
            raise ValueError("hooks: required with PAIRS: where the vectors are read")
        pairs = _read_pairs(Path(args.pairs))
        vector = train_steering_vector(_llm(args), pairs, args.hooks, args.read_token_index, args.aggregator)
        source = f"{len(pairs)} pairs"
    vector.save(args.out)
    _print_table([("hook", "norm")] + [(hook, f"{v.float().norm():.4f}") for hook, v in vector.vectors.items()])
    print(f"wrote {args.out}: {len(vector.vectors)} vectors from {source}")
    return 0


def _read_pairs(path: Path) -> list[tuple[str, str]]:
    """The (positive, negative) prompts of a JSON-lines file; ValueError naming the line at fault."""
    if not path.is_file():
        raise ValueError(f"pairs: {str(path)!r} is not a file")
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            pair = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"pairs: line {number} of {str(path)!r} is not JSON ({e})") from None
        if not (isinstance(pair, dict) and all(isinstance(pair.get(k), str) for k in ("positive", "negative"))):
            raise ValueError(f'pairs: line {number} of {str(path)!r} is not {{"positive": "...", "negative": "..."}}')
        pairs.append((pair["positive"], pair["negative"]))
    return pairs


def _cmd_lens(args: argparse.Namespace) -> int:
    from vlens.viz import lens_page

    _check_out(args.out)
    _at_least("--max-tokens", args.max_tokens, 0)
    _at_least("--top-k", args.top_k, 1)
    sae = None if args.sae is None else SAE.load(args.sae, hook=args.sae_hook)  # before the model loads
    tuned = None if args.tuned_lens is None else TunedLens.load(args.tuned_lens)
    if args.attention_layers:
        layers = _model_config(args).num_layers
        for layer in args.attention_layers:
            if not 0 <= layer < layers:
                raise ValueError(f"--attention-layers: {layer} is not a layer of this model (0 .. {layers - 1})")
    llm = _llm(args)
    view = lens_page(llm, args.prompt, args.max_tokens, args.top_k, sae, args.attention_layers, tuned)
    view.save(args.out)
    tokens, layers = len(view.payload["token_ids"]), len(view.payload["attention"])
    print(f"wrote {args.out}: {tokens} tokens, logit lens and attention at {layers} layers{', SAE features' * bool(sae)}")
    return 0


def _print_features(tokenizer, out, hook: str, ids: torch.Tensor, values: torch.Tensor) -> None:
    """One line per captured row: its position, its token and its top latents (id: value)."""
    print(f"  SAE features at {hook} (top {ids.shape[1]} per row):")
    tokens = out.prompt_token_ids + out.outputs[0].token_ids
    rows = [("position", "token", "features (id: value)")]
    for p, row_ids, row_values in zip(out.activation_positions.tolist(), ids.tolist(), values.tolist()):
        latents = "  ".join(f"{f}: {v:.3f}" for f, v in zip(row_ids, row_values))
        rows.append((str(p), repr(tokenizer.decode([tokens[p]])), latents))
    _print_table(rows)


def _check_out(out: str | None) -> None:
    """An --out that cannot be written fails before the model loads, not in a traceback after it has run."""
    if out is None:
        return
    if Path(out).is_dir():
        raise ValueError(f"--out: {out!r} is a directory; give the path of the file to write")
    if not Path(out).absolute().parent.is_dir():
        raise ValueError(f"--out: the directory of {out!r} does not exist")


def _at_least(flag: str, value: int, minimum: int) -> None:
    """A count flag checked before the model loads (the request it becomes is built only after)."""
    if value < minimum:
        raise ValueError(f"{flag}: must be an integer >= {minimum}, got {value}")


def _model_config(args: argparse.Namespace) -> ModelConfig:
    """The config of the model the command's flags name (MODEL_FLAGS, validated as the engine's settings)."""
    named = from_args(EngineConfig, args)
    return model_config(named.model, named.revision, named.hf_overrides)


def _llm(args: argparse.Namespace) -> LLM:
    """The LLM of the engine settings the command has flags for (the others keep their defaults)."""
    return LLM(**values(from_args(EngineConfig, args)))


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlens", description="Run language models and read exact activations.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("hooks", help="list the model's hook names with their per-token shapes")
    add_flags(p, EngineConfig, only=MODEL_FLAGS)
    p.set_defaults(func=_cmd_hooks)

    p = commands.add_parser(
        "trace", help="capture hooks at every position of some texts", description=TRACE_ABOUT, epilog=TRACE_FILE
    )
    p.add_argument("texts", nargs="+", metavar="TEXT", help="texts to run (before --hooks)")
    p.add_argument(
        "--hooks",
        nargs="+",
        required=True,
        metavar="HOOK",
        help="hook names or globs (quoted), e.g. blocks.10.hook_resid_post 'blocks.{0..3}.hook_attn_out'",
    )
    add_flags(p, EngineConfig, only=MODEL_FLAGS | {"dtype", "device", "tensor_parallel_size"})
    p.add_argument("--image", action="append", metavar="FILE", help="an image of every text (repeat for several; "
                   "vision-language checkpoints), where the text writes the checkpoint's placeholder")  # fmt: skip
    p.add_argument("--out", metavar="FILE", help="also write the activations and token ids to FILE (see below)")
    p.set_defaults(func=_cmd_trace)

    p = commands.add_parser(
        "generate", help="generate completions, optionally capturing activations", description=GENERATE_ABOUT,
        epilog=GENERATE_FILE,
    )  # fmt: skip
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_flags(p, EngineConfig, only=MODEL_FLAGS | {"dtype", "device", "seed", "tensor_parallel_size", "compile_decode"})
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--image", action="append", metavar="FILE",
                   help="an image of every prompt (repeat for several; vision-language checkpoints): with --chat "
                        "before the message's text, else where the prompt writes the checkpoint's placeholder "
                        "(LLaVA's <image>, Gemma 3's <start_of_image>)")  # fmt: skip
    p.add_argument("--capture", nargs="+", metavar="HOOK", help="hook names or globs to capture")
    p.add_argument(
        "--positions", help="all | prompt | generated | last | 0,3,-1 | start:stop[:step] (default: all; generated with --sae)"
    )
    p.add_argument("--sae", metavar="PATH", help="print each row's top SAE latents: a SAELens directory or params.npz")
    p.add_argument("--sae-hook", metavar="HOOK", help="the hook the SAE reads, if its files do not say (params.npz)")
    p.add_argument("--top-k", type=int, default=16, help="latents per row with --sae (default: 16)")
    p.add_argument("--out", metavar="FILE", help="write the activations of --capture or --sae (see below)")
    p.add_argument("--steering-vector", metavar="FILE", help="steer with this file's vectors (`vlens steering-vector`)")
    p.add_argument("--multiplier", type=float, default=1.0, help="times the steering vector (default: 1)")
    p.set_defaults(func=_cmd_generate)

    p = commands.add_parser(
        "steering-vector", help="a steering vector from contrastive pairs or two harvests", description=STEERING_ABOUT,
        epilog=STEERING_PAIRS,
    )  # fmt: skip
    p.add_argument("pairs", metavar="PAIRS", nargs="?", help="the pairs, as JSON lines (before --hooks; see below)")
    p.add_argument("--from-harvests", nargs=2, metavar=("POS", "NEG"),
                   help="instead of pairs: two harvest directories of one model; the vectors are the differences "
                        "of their mean rows")  # fmt: skip
    p.add_argument("--hooks", nargs="+", metavar="HOOK",
                   help="where vectors are read and added (names or globs): 'blocks.{8,10}.hook_resid_post'; with "
                        "--from-harvests, hook names (default: every hook both stored)")  # fmt: skip
    p.add_argument("--out", metavar="FILE", required=True, help="the safetensors file to write")
    p.add_argument("--read-token-index", type=int, default=-1,
                   help="the token each prompt is read at (default: -1, its last)")  # fmt: skip
    p.add_argument("--aggregator", choices=sorted(AGGREGATORS), default="mean",
                   help="mean: the mean difference (default); pca: the differences' principal direction")  # fmt: skip
    add_flags(p, EngineConfig, only=MODEL_FLAGS | {"dtype", "device"})
    p.set_defaults(func=_cmd_steering_vector)

    p = commands.add_parser(
        "lens", help="write the lens page of a prompt as one offline HTML file", description=LENS_ABOUT
    )
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--out", metavar="FILE", required=True, help="the HTML file to write")
    add_flags(p, EngineConfig, only=MODEL_FLAGS | {"dtype", "device"})
    p.add_argument("--max-tokens", type=int, default=0, help="tokens to generate greedily first (default: 0)")
    p.add_argument("--top-k", type=int, default=5, help="tokens per logit-lens cell, latents per token (default: 5)")
    p.add_argument("--sae", metavar="PATH", help="also show this SAE's top latents per token (SAELens dir or params.npz)")
    p.add_argument("--sae-hook", metavar="HOOK", help="the hook the SAE reads, if its files do not say (params.npz)")
    p.add_argument("--tuned-lens", metavar="DIR", help="read the lens through this tuned lens (the tuned-lens package's "
                                                       "directory)")  # fmt: skip
    p.add_argument("--attention-layers", metavar="L", type=int, nargs="+",
                   help="the layers whose attention the page carries (default: every layer; each is heads x tokens^2 / 2 "
                        "weights, so a long prompt on a deep model may want a few)")  # fmt: skip
    p.set_defaults(func=_cmd_lens)

    harvest_cli.add_parser(commands)
    server_cli.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        status = args.func(args)
    except ValueError as e:
        print(f"vlens: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line and the shell's status for SIGINT, not a traceback of the forward
        print("vlens: interrupted", file=sys.stderr)
        return 130
    if "triton" in sys.modules:  # (torch.compile's imports bring it in)
        atexit.register(_quiet_teardown)
    return status


def _quiet_teardown() -> None:
    """Triton 3.9's bindings report dozens of 'nanobind: leaked ...' lines as the interpreter tears them
    down (a known upstream issue, harmless): after a command has done its work, stderr goes to /dev/null for
    the teardown, as Triton does for its own compile workers. Runs first of the exit handlers (the last
    registered), so only what the process prints while it ends is lost."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


if __name__ == "__main__":  # `python -m vlens.cli`, as the installed `vlens` script
    sys.exit(main())
