"""vlens.viz's views as files and notebook cells: each carries the output's own numbers (read back from the
file's embedded payload, bit for bit), makes no request anywhere (no http:// or https:// in it at all),
and refuses an output that lacks what it shows, naming the field."""

from __future__ import annotations

import base64
import json
import re

import pytest
import torch
from sae_helpers import save_saelens

from vlens import SAE, Capture, SamplingParams, viz
from vlens.cli import main

PROMPT = "The cat sat on the"
SAE_HOOK = "blocks.2.hook_resid_post"


def generate(llm, capture: Capture, max_tokens: int = 2):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, capture=capture)
    return llm.generate(PROMPT, params, use_tqdm=False)[0]


def payload_of(html: str) -> dict:
    """The payload a saved page embeds (what its script draws)."""
    [text] = re.findall(r'<script type="application/json" id="vlens-payload">(.*?)</script>', html, re.S)
    return json.loads(text)


def offline(html: str) -> None:
    assert not re.search(r"https?://", html, re.I)
    assert not re.search(r"\bsrc\s*=", html)  # no script, image or frame loaded from anywhere


def test_logit_lens_file_holds_the_outputs_numbers(smol4, tmp_path):
    out = generate(smol4, Capture(hooks="blocks.*.hook_resid_post", logit_lens=3))
    view = viz.logit_lens(out, tokenizer=smol4.tokenizer)
    html = view.save(tmp_path / "lens.html").read_text()
    offline(html)
    payload = payload_of(html)
    assert payload["token_ids"] == out.prompt_token_ids + out.outputs[0].token_ids
    assert payload["completion"] == out.outputs[0].text
    layers = payload["lens"]["layers"]
    assert [entry["layer"] for entry in layers] == [0, 1, 2, 3] and payload["lens"]["k"] == 3
    assert payload["lens"]["tuned"] is False and payload_of(viz.logit_lens(out, tuned=True).html())["lens"]["tuned"]
    for entry in layers:
        ids, logprobs = out.logit_lens[entry["hook"]]
        assert entry["positions"] == out.activation_positions.tolist()
        assert entry["ids"] == ids.tolist() and entry["logprobs"] == logprobs.double().tolist()
        for i in ids.flatten().tolist():  # every token a cell names has its text
            assert payload["texts"][str(i)] == smol4.tokenizer.decode([i])
    first = layers[0]["logprobs"][0][0]
    assert repr(first) in html  # the number itself, as the file's text
    notebook = view._repr_html_()
    offline(notebook)
    assert notebook.startswith("<iframe srcdoc=") and "&lt;script" in notebook


def triangles(entry: dict) -> list[torch.Tensor]:
    """Each head's weights in a payload's attention entry, as the page reads them (a Float32Array each)."""
    return [torch.frombuffer(bytearray(base64.b64decode(w)), dtype=torch.float32) for w in entry["weights"]]


def lower_triangle(pattern: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """One head's [rows, keys]: each row's keys up to its own position, rows one after the other."""
    return torch.cat([pattern[r, : pos + 1] for r, pos in enumerate(positions)])


def test_attention_view_is_the_captured_pattern(smol4, tmp_path):
    out = generate(smol4, Capture(hooks="blocks.1.attn.hook_pattern"))
    pattern = out.activations["blocks.1.attn.hook_pattern"]
    positions = out.activation_positions.tolist()
    assert positions == list(range(6))  # (5 prompt tokens and the first generated one)
    grid = payload_of(viz.attention(out, 1).save(tmp_path / "grid.html").read_text())
    [entry] = grid["attention"]
    assert entry["layer"] == 1 and entry["heads"] == list(range(9)) and entry["positions"] == positions
    # Each head bit for bit, 21 cells of the 6 x 6: the rest are keys after their query, 0 in hook_pattern.
    assert [t.numel() for t in triangles(entry)] == [21] * 9
    for h, got in enumerate(triangles(entry)):
        assert torch.equal(got, lower_triangle(pattern[:, h], positions))
    by_head = pattern.transpose(0, 1)  # [heads, rows, keys]
    assert by_head.triu(diagonal=1).count_nonzero() == 0 and by_head.tril().count_nonzero() == 9 * 21
    html = viz.attention(out, 1, head=4).save(tmp_path / "head.html").read_text()
    offline(html)
    [entry] = payload_of(html)["attention"]
    assert entry["heads"] == [4]
    assert [t.tolist() for t in triangles(entry)] == [lower_triangle(pattern[:, 4], positions).tolist()]
    assert payload_of(html)["texts"] == {}  # without a tokenizer the page names tokens by id
    with pytest.raises(ValueError, match=r"^head: 9 does not exist; blocks.1.attn.hook_pattern has heads 0..8$"):
        viz.attention(out, 1, head=9)
    with pytest.raises(ValueError, match=r"^layer: blocks.2.attn.hook_pattern was not captured"):
        viz.attention(out, 2)


def test_attention_view_of_later_rows_keeps_each_rows_keys(smol4, tmp_path):
    """Rows that start past position 0 (the generated ones): row r still holds keys 0..positions[r]."""
    out = generate(smol4, Capture(hooks="blocks.0.attn.hook_pattern", positions="generated"), max_tokens=4)
    pattern = out.activations["blocks.0.attn.hook_pattern"]
    positions = out.activation_positions.tolist()
    assert positions == [5, 6, 7] and pattern.shape == (3, 9, 8)
    [entry] = payload_of(viz.attention(out, 0).save(tmp_path / "generated.html").read_text())["attention"]
    assert entry["positions"] == positions
    for h, got in enumerate(triangles(entry)):
        assert got.numel() == 6 + 7 + 8 and torch.equal(got, lower_triangle(pattern[:, h], positions))


def test_sae_view_is_the_outputs_features(smol4, tmp_path):
    path = save_saelens(tmp_path / "sae", d_sae=64, seed=3, hook=SAE_HOOK)[0]
    out = generate(smol4, Capture(sae=SAE.load(path), top_k=4, positions="all"))
    html = viz.sae_features(out, tokenizer=smol4.tokenizer).save(tmp_path / "sae.html").read_text()
    offline(html)
    sae = payload_of(html)["sae"]
    ids, values = out.sae_features[SAE_HOOK]
    assert sae["hook"] == SAE_HOOK and sae["positions"] == out.activation_positions.tolist()
    assert sae["ids"] == ids.tolist() and sae["values"] == values.double().tolist()


def test_views_refuse_outputs_without_their_data(smol4):
    out = generate(smol4, Capture(hooks="blocks.1.hook_resid_post"))
    with pytest.raises(ValueError, match=r"^output: no logit lens captured"):
        viz.logit_lens(out)
    with pytest.raises(ValueError, match=r"^output: no top-k SAE features captured"):
        viz.sae_features(out)


def test_lens_command_refuses_bad_input_by_name(smol4_path, tmp_path, capsys):
    out = tmp_path / "lens.html"
    assert main(["lens", "", "--model", str(smol4_path), "--out", str(out)]) == 2
    assert capsys.readouterr().err == "vlens: error: prompts[0]: empty text; give at least one character\n"
    assert not out.exists()


def test_lens_page_carries_the_attention_of_the_layers_asked_for(smol4):
    whole = viz.lens_page(smol4, "The capital of France is")
    some = viz.lens_page(smol4, "The capital of France is", attention_layers=[3, 1, 3])
    assert [part["layer"] for part in whole.payload["attention"]] == [0, 1, 2, 3]
    assert some.payload["attention"] == [whole.payload["attention"][1], whole.payload["attention"][3]]
    assert some.payload["lens"] == whole.payload["lens"]
    assert viz.lens_page(smol4, "The capital of France is", attention_layers=[]).payload["attention"] == []
    with pytest.raises(ValueError, match=r"^attention_layers: 4 is not a layer of this model \(0 \.\. 3\)"):
        viz.lens_page(smol4, "x", attention_layers=[4])
    for odd in (1.0, True):  # equal to a layer, and `in range` says so, but no hook is named by it
        with pytest.raises(ValueError, match=rf"^attention_layers: {odd!r} is not a layer of this model \(0 \.\. 3\)"):
            viz.lens_page(smol4, "x", attention_layers=[odd])


def test_lens_page_of_a_hybrid_carries_the_layers_that_attend(smol_path, tmp_path):
    """Nemotron-H (Mamba 2, MLP and attention layers, each alone) with SmolLM2's tokenizer: the page's attention is
    its attention layer's; a layer without patterns asked for by name is refused, naming those with them."""
    import shutil

    from family_parity import build
    from test_parity_nemotron_h import nemotron_config

    from vlens import LLM

    path = build(nemotron_config(vocab_size=49152), tmp_path, "nemotron_h")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_path / name, f"{path}/{name}")
    llm = LLM(model=path, dtype="float32", device="cpu")
    page = viz.lens_page(llm, "The capital of France is")
    assert [part["layer"] for part in page.payload["attention"]] == [2]
    assert len(page.payload["lens"]["layers"]) == 5
    with pytest.raises(ValueError, match=r"layer 0 of NemotronHForCausalLM does not attend .*; the layers that do: "
                                         r"\[2\]"):  # fmt: skip
        viz.lens_page(llm, "x", attention_layers=[0])


def test_page_text_cannot_break_out_of_its_script():
    """A prompt is data: '</script>' or a template slot in it stays inside the payload."""
    prompt = "</script><script>alert(1)</script> {{js}} <!--"
    payload = {"prompt": prompt, "token_ids": [], "prompt_tokens": 0, "completion": None, "texts": {}, "lens": None,
               "attention": [], "sae": None, "feature": None, "model": None}  # fmt: skip
    html = viz.page_html(payload)
    assert html.count("</script>") == 2 and html.count("<script") == 2  # the payload's and the renderer's
    assert payload_of(html)["prompt"] == prompt
