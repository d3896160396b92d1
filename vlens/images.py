"""Images in a prompt, as vLLM takes them: `{"prompt": text, "multi_modal_data": {"image": image or [images]}}`.

The checkpoint's own HF processor expands each image's placeholder into its tokens and makes the pixels; HF's own
vision tower and projector (its model's `get_image_features`, built from the checkpoint without the language model)
turn them into the rows the language model reads at those tokens. That is HF's model up to its `masked_scatter`, so
the language model's input is HF's by construction, and vlens's taps from `hook_embed` on are exact against HF's
multimodal forward. The features are made once, when the request is admitted; the engine then feeds a prefill
chunk's share of them in place of the placeholders' embedding (vlens.models.base.DecoderLM.embed).

Gemma 3's image tokens also attend to each other both ways in the prefill (`PromptImages.both_ways`: the scheduler ends
no chunk in an image's middle, AttentionMetadata.key_limits says how far each row sees). Qwen2-VL's, Qwen2.5-VL's,
GLM-4.1V's, GLM-4.5V's and Qwen3-VL's rotary reads three positions a row (M-RoPE): an image row's are its time, row
and column in the image, and the text after an image goes on from the image's largest; HF's own `get_rope_index` gives
them (`PromptImages.rope`), and AttentionMetadata.rope_positions carries them to the rotary. Qwen3-VL's language model
also adds rows of the tower's inner layers to the image rows after each of its first layers (deepstack:
`PromptImages.deep`, which DecoderLM.forward reads). The other multimodal checkpoints' text models run on text alone
(vlens.config.TEXT_MODELS)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlens.chat import ChatOptions
from vlens.inputs import ImagePrompt

# the HF architectures whose checkpoints take images (the others' text models still run on text)
IMAGE_FAMILIES = sorted([
    "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration", "AyaVisionForConditionalGeneration",
    "Idefics3ForConditionalGeneration", "LlavaOnevisionForConditionalGeneration", "InternVLForConditionalGeneration",
    "Gemma3ForConditionalGeneration",  # (its image tokens attend to each other both ways: PromptImages)
    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",  # (3-D rotary positions: PromptImages)
    "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",  # (and deepstack: PromptImages.deep)
    "SmolVLMForConditionalGeneration",
    # (the same path, but Pixtral's image processor needs torchvision, which vlens's tests lack: a warning says so)
    "Mistral3ForConditionalGeneration",
])  # fmt: skip
UNTESTED = {"Mistral3ForConditionalGeneration"}
BOTH_WAYS = {"Gemma3ForConditionalGeneration"}  # whose images' tokens attend to each other both ways
# whose rotary reads three positions a row (their models' get_rope_index gives them)
M_ROPE = {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Glm4vForConditionalGeneration",
          "Glm4vMoeForConditionalGeneration", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"}
# HF's processor class of the checkpoints whose AutoProcessor also builds a video processor, which needs torchvision:
# where it is missing, vlens builds that class for images alone (images_only_processor)
VIDEO_PROCESSORS = {
    "Qwen2VLForConditionalGeneration": "Qwen2VLProcessor",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2VLProcessor",  # (Qwen2-VL's, to its videos' timing)
    "Glm4vForConditionalGeneration": "Glm4vProcessor",
    "Glm4vMoeForConditionalGeneration": "Glm4vProcessor",
    "Qwen3VLForConditionalGeneration": "Qwen3VLProcessor",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3VLProcessor",
    "LlavaOnevisionForConditionalGeneration": "LlavaOnevisionProcessor",
    "InternVLForConditionalGeneration": "InternVLProcessor",
    "SmolVLMForConditionalGeneration": "SmolVLMProcessor",
}
log = logging.getLogger("vlens.images")
_TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
TOWER_BATCH = 32  # prompts whose images go through the vision tower at once
# A prompt's image rows kept on the host, by its pixels' digest, up to this many bytes (least recently used out
# first): a chat sends its images again with every turn, a served image is often asked about again.
CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class PromptImages:
    """The rows a prompt's images give its language model: at `positions` (prompt positions, ascending) the
    `features` [len(positions), hidden] (the model's dtype, on the host) in place of the placeholders' embedding.
    `digest` names the pixels: it keys the prefix cache, so two prompts of the same tokens and other images never
    share keys and values past their first image row. `both_ways`: each run of image rows attends to itself both
    ways in the prefill (Gemma 3's: HF's mask with token_type_ids), so a prefill chunk ends at none's middle and
    its rows see keys up to their run's end (`limits`). `rope` [3, prompt length]: each prompt position's three rotary
    positions (M-RoPE, HF's `get_rope_index`), or None where the model's rotary reads one. `deep` [layers,
    len(positions), hidden]: what the image rows add after each of the language model's first layers (Qwen3-VL's
    deepstack), or None."""

    positions: np.ndarray
    features: torch.Tensor
    digest: str
    both_ways: bool = False
    rope: np.ndarray | None = None
    deep: torch.Tensor | None = None

    def placeholders(self) -> list[tuple[int, int]]:
        """(offset, length) of each run of consecutive image positions (an image's tokens, between its text ones)."""
        breaks = np.flatnonzero(np.diff(self.positions) != 1) + 1
        return [(int(run[0]), len(run)) for run in np.split(self.positions, breaks)]

    def chunk(self, start: int, n: int) -> int:
        """How many of the n prompt positions from `start` a prefill chunk may take: n, or up to the start of the
        run it would end inside (0: none this step) where the runs attend both ways."""
        if self.both_ways:
            for offset, length in self.placeholders():
                if offset < start + n < offset + length:
                    return max(0, offset - start)
        return n

    def opening(self, position: int) -> int:
        """Where a forward that changes the rows from `position` on starts: at the first row of the image run it
        falls in where the runs attend both ways (the run's earlier rows see it), else at `position`."""
        if self.both_ways:
            for offset, length in self.placeholders():
                if offset <= position < offset + length:
                    return offset
        return position

    def longest_run(self) -> int:
        return max(length for _, length in self.placeholders()) if self.both_ways else 0

    def limits(self, start: int, n: int) -> np.ndarray | None:
        """Positions [start, start + n): the last key position each may see (its own, or its run's last where the
        runs attend both ways); None where every one sees up to its own."""
        if not self.both_ways:
            return None
        limits = np.arange(start, start + n)
        touched = False
        for offset, length in self.placeholders():
            lo, hi = max(offset, start), min(offset + length, start + n)
            if lo < hi:
                limits[lo - start : hi - start] = offset + length - 1
                touched = True
        return limits if touched else None

    def rope_positions(self, start: int, n: int) -> np.ndarray:
        """[3, n] rotary positions of positions [start, start + n): the prompt's (`rope`), and past its end each
        position moved by as much as the prompt's last (HF's rope delta: what generated tokens take)."""
        at = np.arange(start, start + n)
        if self.rope is None:
            return np.broadcast_to(at, (3, n))
        length = self.rope.shape[1]
        out = np.broadcast_to(at + int(self.rope.max()) + 1 - length, (3, n)).copy()
        inside = at < length
        out[:, inside] = self.rope[:, at[inside]]
        return out

    def within(self, start: int, n: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor | None] | None:
        """The image rows among prompt positions [start, start + n) (a prefill chunk's): their offsets in the chunk,
        their features and their deepstack rows (or None), or None."""
        lo, hi = np.searchsorted(self.positions, [start, start + n])
        if lo == hi:
            return None
        return self.positions[lo:hi] - start, self.features[lo:hi], None if self.deep is None else self.deep[:, lo:hi]


@dataclass(frozen=True)
class Prepared:
    """A prompt as the processor leaves it: its token ids [T], each image's placeholder expanded, and its images'
    vision inputs (pixels, sizes, ...: what the tower reads), on the host."""

    ids: torch.Tensor
    vision: dict[str, torch.Tensor]


class ImageEncoder:
    """A checkpoint's processor and its vision tower and projector (HF's), on the engine's device and dtype."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device, field: str = "multi_modal_data"):
        """`field`: what the request that needs it calls its images, which its errors name."""
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
        from transformers.utils import logging as hf_logging

        config = AutoConfig.from_pretrained(path)
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        if arch not in IMAGE_FAMILIES:
            raise ValueError(f"{field}: {arch} takes no images in vlens (it has no vision tower vlens can run); images "
                             f"are taken by {', '.join(IMAGE_FAMILIES)}")  # fmt: skip
        if arch in UNTESTED:
            log.warning("images on %s take the path tests/test_images.py checks on LLaVA and the other image families, "
                        "but are not themselves checked against HF there", arch)  # fmt: skip
        try:
            self.processor = _images_only(path, arch) if arch in VIDEO_PROCESSORS else \
                AutoProcessor.from_pretrained(path)  # fmt: skip
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(f"{field}: the checkpoint's image processor cannot be built ({e}); images need "
                             "its processor files (preprocessor_config.json, processor_config.json) and Pillow "
                             "(pip install 'vlens[vision]')") from e  # fmt: skip
        # The language model's layers are not built (it is vlens's to run): what loads is the vision tower, the
        # projector and the embedding HF's class keeps beside them, which is then dropped too.
        text = config.text_config
        text.num_hidden_layers = 0
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = []
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # (its load report lists the layers' tensors as unexpected: they are)
        hf_logging.disable_progress_bar()
        try:
            hf = AutoModelForImageTextToText.from_pretrained(path, config=config, dtype=dtype, device_map=device)
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        self.model = hf.model
        for name in ("language_model", "text_model"):  # (Idefics3's and SmolVLM's name for it)
            if hasattr(self.model, name):
                setattr(self.model, name, None)
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
        self.both_ways, self.m_rope = arch in BOTH_WAYS, arch in M_ROPE
        self.model.eval().requires_grad_(False)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # digest -> rows, least recently used first
        self._cached_bytes = 0
        self._lock = threading.Lock()  # (the server encodes from threads)
        self.tower_prompts = 0  # prompts whose images went through the tower (not from the cache)

    def chat_template(self, field: str) -> str:
        """The processor's chat template, which renders conversations with images."""
        template = getattr(self.processor, "chat_template", None)
        if not template:
            raise ValueError(f"{field}: this checkpoint's processor has no chat template to render a conversation "
                             "with images; give its text written out, the images' placeholders in it")  # fmt: skip
        return template

    def render_chat(self, conversation: list[dict], field: str, options: ChatOptions = ChatOptions()) -> str:
        """A conversation with images (as chat_images leaves it: {"type": "image"} parts) through the processor's
        chat template (by default ending in the opening of the assistant's reply)."""
        if options.chat_template is None:
            self.chat_template(field)
        return options.render(self.processor, conversation, field)

    def encode(
        self, prompts: Sequence[ImagePrompt], fields: Sequence[str], add_special_tokens: bool = True
    ) -> list[tuple[list[int], PromptImages]]:
        """Each prompt's token ids, each image's placeholder expanded, and its images' rows (a chat template's text
        holds its special tokens already: add_special_tokens=False)."""
        prepared = [self.prepare(prompt, field, add_special_tokens) for prompt, field in zip(prompts, fields)]
        return [(p.ids.tolist(), images) for p, images in zip(prepared, self.rows(prepared, fields))]

    def prepare(self, prompt: ImagePrompt, field: str, add_special_tokens: bool = True) -> Prepared:
        """What the processor makes of one prompt (its own work alone: no tower runs)."""
        try:
            inputs = self.processor(text=prompt.text, images=[list(prompt.images)], return_tensors="pt",
                                    add_special_tokens=add_special_tokens)  # fmt: skip
        except Exception as e:  # (the processor's own: a count of placeholders and images that differ, a bad image)
            raise ValueError(f"{field}: the processor refused the prompt and its images: {e}") from e
        return Prepared(inputs["input_ids"][0], {k: v for k, v in inputs.items() if k not in _TEXT_INPUTS})

    @torch.inference_mode()
    def rows(self, prepared: Sequence[Prepared], fields: Sequence[str]) -> list[PromptImages]:
        """The rows each prepared prompt's images give its language model (`fields`: what each one's errors name).
        Pixels seen lately are read from the cache (CACHE_BYTES); the others go through the tower together,
        TOWER_BATCH prompts at a time of those whose pixel tensors have the same shape (LLaVA-NeXT's tile count
        follows the image's); each prompt's rows are what it alone would give, up to the tower's float rounding at
        another batch size."""
        digests = [_digest(p.vision) for p in prepared]
        rows: list[torch.Tensor | None] = [self._cached(d) for d in digests]
        alike: dict[tuple, list[int]] = {}
        first = {}  # digest -> the one prompt of this call whose images the tower runs
        for i, p in enumerate(prepared):
            if rows[i] is None and first.setdefault(digests[i], i) == i:
                alike.setdefault(tuple((k, v.shape[1:]) for k, v in p.vision.items()), []).append(i)
        for group in alike.values():
            for start in range(0, len(group), TOWER_BATCH):
                members = group[start : start + TOWER_BATCH]
                vision = {k: torch.cat([prepared[i].vision[k] for i in members]) for k in prepared[members[0]].vision}
                features = self._features(vision)
                counts = [int((prepared[i].ids == self.image_token_id).sum()) for i in members]
                if sum(counts) != features.shape[1]:
                    raise ValueError(f"{fields[members[0]]}: {sum(counts)} image tokens in the prompts for "
                                     f"{features.shape[1]} image rows; give each image its placeholder "
                                     "once")  # fmt: skip
                for i, part in zip(members, features.split(counts, dim=1)):
                    rows[i] = part
                    self._keep(digests[i], part)
                self.tower_prompts += len(members)
        out = []
        for p, features, digest in zip(prepared, rows, digests):
            positions = (p.ids == self.image_token_id).nonzero().flatten().numpy()
            features = rows[first[digest]] if features is None else features  # (the same pixels twice in a call)
            deep = features[1:] if len(features) > 1 else None
            out.append(PromptImages(positions, features[0], digest, self.both_ways, self._rope(p), deep))
        return out

    def _rope(self, prepared: Prepared) -> np.ndarray | None:
        """[3, T] HF's rotary positions of a prompt (M-RoPE), or None where the model's rotary reads one."""
        if not self.m_rope:
            return None
        ids = prepared.ids[None].to(self.model.device)
        grid = prepared.vision["image_grid_thw"].to(self.model.device)
        rope, _ = self.model.get_rope_index(ids, (ids == self.image_token_id).int(), image_grid_thw=grid)
        return rope[:, 0].cpu().numpy()

    def _cached(self, digest: str) -> torch.Tensor | None:
        with self._lock:
            rows = self._cache.get(digest)
            if rows is not None:
                self._cache.move_to_end(digest)
            return rows

    def _keep(self, digest: str, rows: torch.Tensor) -> None:
        """Cache a copy of `rows` (a view would keep its whole tower batch alive)."""
        size = rows.numel() * rows.element_size()
        if size > CACHE_BYTES:
            return
        rows = rows.clone().pin_memory() if self.model.device.type == "cuda" else rows.clone()
        with self._lock:
            if digest in self._cache:
                return
            self._cache[digest] = rows
            self._cached_bytes += size
            while self._cached_bytes > CACHE_BYTES:
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= dropped.numel() * dropped.element_size()

    def _features(self, vision: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tower's rows [1 + deepstack layers, images' tokens, hidden] of a batch of vision inputs: what the
        language model reads at the image tokens, then what it adds there after each of its first layers (Qwen3-VL's
        deepstack; none elsewhere). On the host (pinned beside a GPU, so a step's share goes to the device without a
        sync): a call's images may be many, the device's memory is the KV cache's."""
        vision = {k: v.to(self.model.device) for k, v in vision.items()}
        if "pixel_values" in vision:
            vision["pixel_values"] = vision["pixel_values"].to(self.model.dtype)
        out = self.model.get_image_features(**vision, return_dict=True)
        parts = [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
        parts = [torch.cat(list(p)) if isinstance(p, (list, tuple)) else p for p in parts]  # (split by image: joined)
        features = torch.stack([p.reshape(-1, p.shape[-1]) for p in parts]).to("cpu", self.model.dtype)
        return features.pin_memory() if self.model.device.type == "cuda" else features


def _images_only(path: Path, arch: str) -> Any:
    """The processor of a checkpoint of `arch` (VIDEO_PROCESSORS): HF's `AutoProcessor` where it can be built
    (its video processor needs torchvision), else for images alone (`images_only_processor`), with the checkpoint's
    chat template and its processor's settings (processor_config.json: LLaVA-OneVision's image token count, ...)."""
    import inspect

    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        with contextlib.suppress(OSError, ValueError, ImportError):
            return AutoProcessor.from_pretrained(path)
    template = None
    for name in ("chat_template.jinja", "chat_template.json"):  # (where HF's processors keep it, newest first)
        file = Path(path, name)
        if template is None and file.is_file():
            template = json.loads(file.read_text())["chat_template"] if name.endswith(".json") else file.read_text()
    file, name = Path(path, "processor_config.json"), VIDEO_PROCESSORS[arch]
    saved = json.loads(file.read_text()) if file.is_file() else {}
    slots = {"self", "image_processor", "tokenizer", "video_processor", "chat_template", "args", "kwargs"}
    taken = set(inspect.signature(getattr(transformers, name).__init__).parameters) - slots
    return images_only_processor(name, AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                                 template, **{k: v for k, v in saved.items() if k in taken})  # fmt: skip


def images_only_processor(
    name: str, image_processor: Any, tokenizer: Any, chat_template: str | None = None, **settings: Any
) -> Any:
    """HF's processor class `name` (VIDEO_PROCESSORS: Qwen2VLProcessor, ...) without a video processor, which HF's
    class insists on: images need none (without torchvision the image processor is HF's PIL one)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(getattr(transformers, name)):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            # (SmolVLM's own reads its video processor's frame counts first; the others have none of their own)
            return ProcessorMixin.apply_chat_template(self, *args, **kwargs)

    return ImagesOnly(image_processor, tokenizer, None, chat_template=chat_template, **settings)


def _digest(vision: dict[str, torch.Tensor]) -> str:
    """What names a prompt's images: a hash of its vision inputs' bytes (pixels, sizes)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in vision.items():
        digest.update(name.encode())
        digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def chat_images(conversation: list[dict], field: str, local_files: bool) -> tuple[list[dict], list[Any]] | None:
    """A conversation whose contents hold images, as the processor's chat template takes it ({"type": "image"} where
    each was) and its images in order; None when it holds none. The parts taken are vLLM's: {"type": "text"},
    {"type": "image_url", "image_url": {"url": a data: URL (or, with `local_files`, a file path or file:// URL)}},
    {"type": "image_pil", "image_pil": a PIL image}."""
    if not any(isinstance(m.get("content"), list) and any(_is_image(p) for p in m["content"]) for m in conversation):
        return None
    images, rendered = [], []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"{field}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_pil":
                images.append(part["image_pil"])
                parts.append({"type": "image"})
            elif kind == "image_url":
                url = part["image_url"]["url"] if isinstance(part.get("image_url"), dict) else part.get("image_url")
                images.append(load_image(url, f"{where}.image_url.url", local_files))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"{where}: a part's type is one of text, image_url, image_pil; got {kind!r}")
        rendered.append({**message, "content": parts})
    return rendered, images


def load_image(url: Any, field: str, local_files: bool) -> Any:
    """A PIL image from a data: URL (base64) or a file's bytes, or with `local_files` a path or file:// URL (`field`:
    what errors name). vlens fetches nothing from the network: a client sends the bytes."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(f"{field}: reading images needs Pillow: pip install 'vlens[vision]'") from None

    if not isinstance(url, (str, bytes, bytearray)):
        raise ValueError(f"{field}: expected a string, got {type(url).__name__}")
    try:
        if isinstance(url, (bytes, bytearray)):
            image = Image.open(io.BytesIO(url))
        elif url.startswith("data:"):
            header, _, payload = url.partition(",")
            if not header.endswith(";base64"):
                raise ValueError("a data: URL of an image is base64 (data:image/png;base64,...)")
            image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        elif local_files and not url.startswith(("http://", "https://")):
            image = Image.open(url.removeprefix("file://"))
        else:
            allowed = "a data: URL, a file path or a file:// URL" if local_files else "a data: URL (base64)"
            raise ValueError(f"vlens fetches no images; give {allowed}")
        image.load()
    except (OSError, ValueError, binascii.Error) as e:
        raise ValueError(f"{field}: not an image vlens can read: {e}") from None
    return image


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image_pil")
