"""Prompts with images: vlens against Hugging Face `generate` on a LLaVA checkpoint, in one run, as ratios.

    .venv/bin/python benchmarks/bench_images.py [--prompts 32] [--tokens 32] [--repeats 1]

A random LLaVA (the processor's own expansion of <image>, SmolLM2's tokenizer): a text model of SmolLM2's widths,
8 layers, and a CLIP tower of 4 layers, d=256, 224-pixel images in 16-pixel patches (196 image rows a prompt),
float32, this machine's CPU. Each prompt is a question of 8-24 words about its own image; both sides generate
exactly --tokens new tokens per prompt, greedy, vlens without its prefix cache and its cache of image rows (the
timed runs repeat the warm-up's prompts). HF runs the processor on the whole batch (left-padded) and one
`generate`; vlens's LLM.generate takes vLLM's multi_modal_data, each prompt through the processor and the images
through the tower 32 prompts at a time before the requests are queued (their time included). Rows:
  no capture          output tokens/s, vlens vs HF
  capture 3 layers    vlens capturing blocks.{1,4,7}.hook_resid_post at every prompt row (the image's among them)
                      against HF with output_hidden_states=True (every layer, every step)
  harvest 1 layer     rows/s of an activation dataset of the prompts (records of a text and a PNG file):
                      `harvest(..., image_field=)` storing blocks.4.hook_resid_post at every row against HF over
                      --batch prompts at a time (the processor, right-padded), a forward stopped after that layer,
                      each batch's real rows written to a safetensors file (bench_harvest's "HF hook-stop")
  no capture, seen    the no-capture row with vlens's cache of image rows on (256 MiB), every image seen before (a
                      chat's next turn, an image asked about again): the tower is skipped, HF's runs it again
Timings are the best of --repeats runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from bench_generate import best
from bench_harvest import stopped_at
from PIL import Image
from safetensors.torch import save_file
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaProcessor,
)

from vlens import LLM, Capture, SamplingParams, harvest
from vlens import images as vlens_images
from vlens.loader import resolve_model_path

WORDS = "what is shown in this picture and how many colours does it hold near the top left corner".split()


def checkpoint(root: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=len(tok), max_position_embeddings=2048)  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              image_size=224, patch_size=16, projection_dim=256)  # fmt: skip
    config = LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(root)
    LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 224}), tokenizer=tok, patch_size=16,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   image_token="<image>").save_pretrained(root)  # fmt: skip
    return root


def workload(n: int) -> tuple[list[str], list[Image.Image]]:
    rng = random.Random(0)
    texts = [f"USER: <image>\n{' '.join(rng.choices(WORDS, k=rng.randint(8, 24)))}? ASSISTANT:" for _ in range(n)]
    images = [Image.fromarray(np.random.RandomState(i).randint(0, 255, (rng.randint(200, 400), 300, 3), np.uint8))
              for i in range(n)]  # fmt: skip
    return texts, images


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="prompts per HF forward in the harvest row (default: 8)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp))
        texts, images = workload(args.prompts)
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
        processor.tokenizer.padding_side = "left"
        # (no prefix cache and no cache of image rows: the timed runs repeat the warm-up's prompts, whose blocks and
        # image rows they would serve)
        llm = LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=False)
        cache_bytes, vlens_images.CACHE_BYTES = vlens_images.CACHE_BYTES, 0
        prompts = [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in zip(texts, images)]
        n_out = args.prompts * args.tokens
        layers = [f"blocks.{i}.hook_resid_post" for i in (1, 4, 7)]

        def hf_run(hidden: bool) -> None:
            inputs = processor(text=texts, images=images, return_tensors="pt", padding=True)
            with torch.inference_mode():
                hf.generate(**inputs, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                            pad_token_id=0, output_hidden_states=hidden, return_dict_in_generate=hidden)  # fmt: skip

        def vlens_run(capture: Capture | None, cached: bool = False) -> None:
            vlens_images.CACHE_BYTES = cache_bytes if cached else 0
            params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, capture=capture)
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)

        files = []
        for i, image in enumerate(images):
            image.save(Path(tmp) / f"{i}.png")
            files.append(Path(tmp) / f"{i}.png")
        source = Path(tmp) / "records.jsonl"
        source.write_text("".join(json.dumps({"text": t, "images": f.name}) + "\n" for t, f in zip(texts, files)))
        n_rows = sum(len(processor(text=t, images=[i])["input_ids"][0]) for t, i in zip(texts, images))

        def hf_harvest() -> None:
            out = Path(tmp) / "hf"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            processor.tokenizer.padding_side = "right"
            for start in range(0, args.prompts, args.batch):
                batch = [Image.open(f) for f in files[start : start + args.batch]]
                inputs = processor(text=texts[start : start + args.batch], images=batch, return_tensors="pt",
                                   padding=True)  # fmt: skip
                rows = stopped_at(hf, 4, **inputs)[inputs["attention_mask"].bool()]
                save_file({"blocks.4.hook_resid_post": rows.contiguous()}, out / f"{start}.safetensors")
            processor.tokenizer.padding_side = "left"

        def vlens_harvest() -> None:
            out = Path(tmp) / "vlens"
            shutil.rmtree(out, ignore_errors=True)
            harvest(llm, source, ["blocks.4.hook_resid_post"], out, context_size=1024, pack=False, dtype="float32",
                    image_field="images", progress=False)  # fmt: skip

        rows = [("case", "HF per s", "vlens per s", "vlens / HF")]
        for name, count, hf_fn, vlens_fn in (
            ("no capture (tokens)", n_out, lambda: hf_run(False), lambda: vlens_run(None)),
            ("capture 3 layers (tokens)", n_out, lambda: hf_run(True),
             lambda: vlens_run(Capture(hooks=layers, positions="prompt"))),
            ("harvest 1 layer (rows)", n_rows, hf_harvest, vlens_harvest),
            # (last: from here on the cache holds every image's rows)
            ("no capture, seen (tokens)", n_out, lambda: hf_run(False), lambda: vlens_run(None, cached=True)),
        ):  # fmt: skip
            t_hf, t_vlens = best(hf_fn, args.repeats), best(vlens_fn, args.repeats)
            rows.append((name, f"{count / t_hf:.1f}", f"{count / t_vlens:.1f}", f"{t_hf / t_vlens:.2f}x"))
        print(f"{args.prompts} prompts with a 224-pixel image (196 image rows) x {args.tokens} new tokens, float32, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        for r in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))


if __name__ == "__main__":
    main()
