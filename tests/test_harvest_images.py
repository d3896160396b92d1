"""A harvest of records with images (vlens.harvest, `image_field`): LLaVA's and Gemma 3's tiny random checkpoints
(tests/test_images.py's), records of a text and its images from .jsonl (paths, data: URLs, lists), .parquet (the
{bytes, path} structs of a `datasets` Image column) and a `datasets` directory: every stored row is what LLM.trace
gives the record as an image prompt, a killed run resumes to the same bytes, and bad input is refused by name."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from harvest_helpers import dir_bytes, read_shards, window_rows
from hf_reference import same
from test_images import KV, PLUMBING, at, checkpoint, image

from vlens import LLM, harvest
from vlens.harvest import job
from vlens.inputs import ImagePrompt

HOOKS = ["hook_embed", "blocks.0.hook_resid_post", "ln_final.hook_out"]
OPTIONS = dict(context_size=64, pack=False, dtype="float32", image_field="images", progress=False)


@pytest.fixture(scope="module", params=PLUMBING)
def vlm(request, smol_path, tmp_path_factory) -> tuple[str, LLM]:
    name = request.param
    path = checkpoint(name, smol_path, tmp_path_factory.mktemp(name))
    return name, LLM(model=path, dtype="float32", device="cpu", kv_cache_memory=KV)


def records(name: str, root: Path) -> list[dict]:
    """A text around one image (a file named from the source's directory), one around an image given as a data:
    URL, a text with two images (a list), and a text with none."""
    image(0).save(root / "first.png")
    png = io.BytesIO()
    image(1, 60, 30).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    image(3, 30, 60).save(root / "third.png")
    return [
        {"text": at(name, "USER: <image>\nWhat is shown here? ASSISTANT: a cat."), "images": "first.png"},
        {"text": at(name, "Describe <image> briefly: nothing much."), "images": url},
        {"text": "A text alone, with no image at all.", "images": None},
        {"text": at(name, "Compare <image> with <image>: the same."), "images": [str(root / "first.png"), "third.png"]},
    ]


def prompts(name: str, root: Path) -> list:
    """The records as LLM.trace takes them."""
    from PIL import Image

    out = []
    for record in records(name, root):
        paths = record["images"] if isinstance(record["images"], list) else [record["images"]]
        if record["images"] is None:
            out.append(record["text"])
            continue
        images = []
        for p in paths:
            if p.startswith("data:"):
                images.append(Image.open(io.BytesIO(base64.b64decode(p.partition(",")[2]))))
            else:
                images.append(Image.open(root / p))
        out.append({"prompt": record["text"], "multi_modal_data": {"image": images}})
    return out


def write_jsonl(root: Path, rows: list[dict]) -> Path:
    path = root / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_are_trace_s_and_the_manifest_names_the_image_token(vlm, tmp_path):
    """Each record is a window (a few windows a forward, shards of a few windows): every stored row, the image rows
    among them, is what LLM.trace gives the record as an image prompt; the token ids are the processor's."""
    name, llm = vlm
    source = write_jsonl(tmp_path, records(name, tmp_path))
    summary = harvest(llm, source, HOOKS, tmp_path / "out", shard_bytes=12_000, batch_tokens=16, **OPTIONS)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 1 and summary.windows == 4
    image_token = llm.image_encoder().image_token_id
    assert manifest["image_token_id"] == image_token and manifest["source"]["image_field"] == "images"
    shards = read_shards(tmp_path / "out")
    traced = llm.trace(prompts(name, tmp_path), hooks=HOOKS)
    for w, (prompt, want) in enumerate(zip(prompts(name, tmp_path), traced)):
        rows = window_rows(shards, w)
        if isinstance(prompt, dict):
            ids = ids_of(llm, prompt)
            assert rows["token_ids"].tolist() == ids and image_token in ids
        assert rows["position"].tolist() == list(range(len(want["hook_embed"])))
        for hook in HOOKS:
            assert same(rows[hook], want[hook], 1e-5), (w, hook)
    # a text longer than the window is cut after its last image token, and its rows are the first ones of the whole
    first = records(name, tmp_path)[:1]
    end = max(p for p, t in enumerate(ids_of(llm, prompts(name, tmp_path)[0])) if t == image_token) + 1
    harvest(llm, write_jsonl(tmp_path, first), HOOKS, tmp_path / "cut", **dict(OPTIONS, context_size=end + 2))
    rows = window_rows(read_shards(tmp_path / "cut"), 0)
    assert len(rows["token_ids"]) == end + 2 < len(traced[0]["hook_embed"])
    assert all(same(rows[hook], traced[0][hook][: end + 2], 1e-5) for hook in HOOKS)


def test_a_harvest_through_an_llm_runs_the_llm_s_tower(vlm, tmp_path):
    """A harvest given an LLM takes its vision tower (not a second copy loaded from disk), and the cache of image
    rows with it: three records asking of one image run the tower once, and a later generation about it none."""
    name, llm = vlm
    encoder = llm.image_encoder()
    image(5).save(tmp_path / "five.png")
    questions = [at(name, f"USER: <image>\nQuestion {i}? ASSISTANT: yes.") for i in range(3)]
    before = encoder.tower_prompts
    harvest(llm, write_jsonl(tmp_path, [{"text": q, "images": "five.png"} for q in questions]), HOOKS,
            tmp_path / "out", **OPTIONS)  # fmt: skip
    assert llm.image_encoder() is encoder and encoder.tower_prompts == before + 1
    rows = read_shards(tmp_path / "out")
    traced = llm.trace([{"prompt": q, "multi_modal_data": {"image": image(5)}} for q in questions], hooks=HOOKS)
    assert encoder.tower_prompts == before + 1
    for w, want in enumerate(traced):
        assert all(same(window_rows(rows, w)[hook], want[hook], 1e-5) for hook in HOOKS), w


def ids_of(llm: LLM, prompt: dict) -> list[int]:
    """An image prompt's token ids, its placeholders expanded (the processor's)."""
    image_prompt = ImagePrompt(prompt["prompt"], prompt["multi_modal_data"]["image"])
    return llm.image_encoder().prepare(image_prompt, "prompt").ids.tolist()


def test_columnar_sources_give_the_same_rows(vlm, tmp_path):
    """The records as Parquet ({bytes, path} structs, as `datasets` writes an Image column) and as a `datasets`
    directory with an Image feature: the same shards as the .jsonl's."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    name, llm = vlm
    rows = records(name, tmp_path)
    harvest(llm, write_jsonl(tmp_path, rows), HOOKS, tmp_path / "jsonl", **OPTIONS)

    def as_bytes(value):
        if value.startswith("data:"):
            return base64.b64decode(value.partition(",")[2])
        return (tmp_path / value).read_bytes()

    listed = [[] if r["images"] is None else r["images"] if isinstance(r["images"], list) else [r["images"]]
              for r in rows]  # fmt: skip
    structs = [[{"bytes": as_bytes(v), "path": None} for v in images] for images in listed]
    table = pa.table({"text": [r["text"] for r in rows], "images": structs})
    pq.write_table(table, tmp_path / "records.parquet")
    harvest(llm, tmp_path / "records.parquet", HOOKS, tmp_path / "parquet", **OPTIONS)
    features = datasets.Features({"text": datasets.Value("string"), "images": [datasets.Image()]})
    data = datasets.Dataset.from_dict({"text": table["text"].to_pylist(), "images": structs}, features=features)
    data.save_to_disk(str(tmp_path / "records_ds"))
    harvest(llm, tmp_path / "records_ds", HOOKS, tmp_path / "datasets", **OPTIONS)
    want = read_shards(tmp_path / "jsonl")
    for out in ("parquet", "datasets"):
        got = read_shards(tmp_path / out)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), out


def conversations(name: str, root: Path) -> list[dict]:
    """Records as TRL's and Hugging Face's multimodal chat datasets hold them: messages whose {"type": "image"} parts
    the record's images fill, in order. One image; two, in two turns after a system prompt and a text content; none
    (text parts alone)."""
    image(0).save(root / "first.png")
    image(3, 30, 60).save(root / "third.png")

    def ask(text: str) -> list[dict]:
        return [{"type": "image"}, {"type": "text", "text": at(name, text)}]

    def say(text: str) -> list[dict]:
        return [{"type": "text", "text": text}]

    return [
        {"messages": [{"role": "user", "content": ask("What is shown here?")},
                      {"role": "assistant", "content": say("A cat.")}], "images": ["first.png"]},
        {"messages": [{"role": "system", "content": say("Be brief.")}, {"role": "user", "content": ask("And this?")},
                      {"role": "assistant", "content": say("Noise.")}, {"role": "user", "content": ask("Compare.")}],
         "images": ["third.png", "first.png"]},
        {"messages": [{"role": "user", "content": say("No picture today.")},
                      {"role": "assistant", "content": say("Fine.")}], "images": []},
    ]  # fmt: skip


def test_conversations_with_images_are_rendered_by_the_processor(vlm, tmp_path):
    """A column of conversations beside the images: each rendered by the processor's chat template as HF's renders
    it (no generation prompt), its image parts expanded, every stored row trace's of that text and those images;
    the same from a `datasets` directory (a list of Image and messages of parts, as llava-instruct-mix-vsft); the
    manifest pins the processor's template."""
    import datasets
    from PIL import Image
    from test_images import load_processor

    name, llm = vlm
    rows = conversations(name, tmp_path)
    harvest(llm, write_jsonl(tmp_path, rows), HOOKS, tmp_path / "out", **OPTIONS)
    processor = load_processor(llm.model_path)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    template = manifest["tokenizer"]["chat_template_sha256"]
    assert template == hashlib.sha256(processor.chat_template.encode()).hexdigest()
    shards = read_shards(tmp_path / "out")
    for w, record in enumerate(rows):
        text = processor.apply_chat_template(record["messages"], add_generation_prompt=False, tokenize=False)
        pictures = [Image.open(tmp_path / f) for f in record["images"]]
        prompt = {"prompt": text, "multi_modal_data": {"image": pictures}} if pictures else text
        want = llm.trace([prompt], hooks=HOOKS)[0]
        got = window_rows(shards, w)
        if pictures:
            ids = processor(text=text, images=[pictures], return_tensors="pt")["input_ids"][0].tolist()
            assert got["token_ids"].tolist() == ids and ids.count(llm.image_encoder().image_token_id) > len(pictures)
        assert all(same(got[hook], want[hook], 1e-5) for hook in HOOKS), w
    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        "images": [datasets.Image()],
    })  # fmt: skip
    records = {"messages": [r["messages"] for r in rows],
               "images": [[str(tmp_path / f) for f in r["images"]] for r in rows]}  # fmt: skip
    datasets.Dataset.from_dict(records, features=features).save_to_disk(str(tmp_path / "records_ds"))
    harvest(llm, tmp_path / "records_ds", HOOKS, tmp_path / "datasets", **dict(OPTIONS, text_field="messages"))
    again = read_shards(tmp_path / "datasets")
    assert again.keys() == shards.keys() and all(torch.equal(again[k], shards[k]) for k in shards)


def test_the_command_line_writes_the_same_shards(vlm, tmp_path):
    """`vlens harvest --image-field images --no-pack` stores what harvest(..., image_field=, pack=False) stores."""
    import argparse

    from vlens.harvest.cli import add_parser

    name, llm = vlm
    source = write_jsonl(tmp_path, records(name, tmp_path))
    harvest(llm, source, HOOKS, tmp_path / "python", **OPTIONS)
    parser = argparse.ArgumentParser(prog="vlens")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["harvest", "--model", str(llm.model_path), "--model-dtype", "float32", "--device", "cpu", "--source",
         str(source), "--hooks", *HOOKS, "--out", str(tmp_path / "cli"), "--context-size", "64", "--no-pack",
         "--dtype", "float32", "--image-field", "images", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    want, got = read_shards(tmp_path / "python"), read_shards(tmp_path / "cli")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_killed_run_resumes_to_the_same_bytes(vlm, tmp_path, monkeypatch):
    """A run killed in its third forward (the source read ahead, a shard written) resumes to the bytes of a run
    that was never stopped."""
    name, llm = vlm
    source = write_jsonl(tmp_path, records(name, tmp_path))
    options = dict(OPTIONS, shard_bytes=12_000, batch_tokens=16)
    harvest(llm, source, HOOKS, tmp_path / "whole", **options)
    forward, calls = job.forward, []

    def dies(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    monkeypatch.setattr(job, "forward", dies)
    with pytest.raises(KeyboardInterrupt):
        harvest(llm, source, HOOKS, tmp_path / "resumed", **options)
    monkeypatch.setattr(job, "forward", forward)
    assert 0 < len(json.loads((tmp_path / "resumed" / "manifest.json").read_text())["shards"]) < 4
    summary = harvest(llm, source, HOOKS, tmp_path / "resumed", **options)
    assert 0 < summary.tokens_this_run < summary.tokens
    assert dir_bytes(tmp_path / "resumed") == dir_bytes(tmp_path / "whole")


def test_bad_input_is_refused_by_name(vlm, smol, tmp_path):
    name, llm = vlm
    good = records(name, tmp_path)
    source = write_jsonl(tmp_path, good)
    out = tmp_path / "out"
    refusals = [
        (dict(OPTIONS, pack=True), r"^image_field: a record with images is one window of its own, which needs pack"),
        (dict(OPTIONS, generate_tokens=4), r"^generate_tokens: 4 does not go with image_field"),
        (dict(OPTIONS, context_size=4), r"^context_size: .* line 1 has \d+ tokens up to its last image's end"),
        (dict(OPTIONS, image_field="pictures"), r"^image_field: 'pictures' missing from .* line 1"),
    ]
    for options, message in refusals:
        with pytest.raises(ValueError, match=message):
            harvest(llm, source, HOOKS, out, **options)
    (tmp_path / "notes.txt").write_text("a text\n")
    with pytest.raises(ValueError, match=r"^image_field: 'images' names a column, and a .txt file has none"):
        harvest(llm, tmp_path / "notes.txt", HOOKS, out, **OPTIONS)
    broken = write_jsonl(tmp_path, [dict(good[0], images="notes.txt")])
    with pytest.raises(ValueError, match=r"^image_field of .* line 1: not an image vlens can read"):
        harvest(llm, broken, HOOKS, out, **OPTIONS)
    with pytest.raises(ValueError, match=r"^image_field: LlamaForCausalLM takes no images"):
        harvest(smol, source, HOOKS, out, **OPTIONS)
    chats = conversations(name, tmp_path)
    talk = write_jsonl(tmp_path, chats)
    with pytest.raises(ValueError, match=r"^roles: \('assistant',\) does not go with image_field"):
        harvest(llm, talk, HOOKS, out, **dict(OPTIONS, roles=["assistant"]))
    with pytest.raises(ValueError, match=r"^text_field: a message in .* line 1 holds an image part; a source of "
                                         r"images needs image_field"):  # fmt: skip
        harvest(llm, talk, HOOKS, out, **dict(OPTIONS, image_field=None))
    one_too_many = write_jsonl(tmp_path, [dict(chats[0], images=["first.png", "third.png"])])
    with pytest.raises(ValueError, match=r"^.* line 1: the processor refused the prompt and its images"):
        harvest(llm, one_too_many, HOOKS, out, **OPTIONS)
    assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.iterdir())
