"""The logit lens over an image's tokens: at each layer, the words a vision-language model's residual stream already
points to where it reads the image (on a real LLaVA or Gemma 3, the objects in the picture surface in the middle
layers). Every row is HF's; the image rows are picked by the output's `multi_modal_placeholders`.

    .venv/bin/python examples/image_logit_lens.py --model llava-hf/llava-1.5-7b-hf --image cat.png \\
        [--prompt "USER: <image>\\nWhat is this? ASSISTANT:"] [--top 5]

(Gemma 3's prompt puts <start_of_image> where the image goes.)
"""

from __future__ import annotations

import argparse
from collections import Counter

from PIL import Image

from vlens import LLM, Capture, SamplingParams


def image_lens(llm: LLM, prompt: str, image: Image.Image, top: int = 5) -> list[tuple[int, list[tuple[str, int]]]]:
    """Per layer, the `top` most frequent top-1 logit-lens tokens over the image's rows, with how many rows chose
    each."""
    capture = Capture(hooks="blocks.*.hook_resid_post", positions="prompt", logit_lens=1)
    [out] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                         SamplingParams(max_tokens=1, capture=capture), use_tqdm=False)  # fmt: skip
    rows = [p for r in out.multi_modal_placeholders["image"] for p in range(r.offset, r.offset + r.length)]
    where = {int(p): i for i, p in enumerate(out.activation_positions.tolist())}
    table = []
    for layer in range(llm.config.num_layers):
        ids, _ = out.logit_lens[f"blocks.{layer}.hook_resid_post"]
        counts = Counter(int(ids[where[p], 0]) for p in rows)
        table.append((layer, [(llm.tokenizer.decode([t]), n) for t, n in counts.most_common(top)]))
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("--prompt", default="USER: <image>\nWhat is this? ASSISTANT:")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)
    llm = LLM(args.model)
    for layer, words in image_lens(llm, args.prompt, Image.open(args.image), args.top):
        print(f"layer {layer:2d}: " + ", ".join(f"{w!r} x{n}" for w, n in words))


if __name__ == "__main__":
    main()
