"""The /lens page of `vlens serve` in a real headless Chromium (Debian's `chromium`, driven by Playwright; no
browser download): every number the page shows is the server's own (logit lens, attention, SAE features,
steered completions), bad input shows the server's error next to its field without stale results, and no
request leaves the machine. The same page as an offline file (`vlens lens`) renders the same cells."""

from __future__ import annotations

import colorsys
import json
import math
import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from sae_helpers import save_saelens
from server_helpers import decode_activations, vlens_serve

from vlens import Capture, SamplingParams, TunedLens, viz
from vlens.cli import main
from vlens.steering import SteeringVector

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; .ci/run installs it where it is missing
KEY = "lens-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The cat sat on the"
K = 5  # the page's top-k
SAE_HOOK = "blocks.2.hook_resid_post"
SERVE = ["--enable-capture", "--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--max-model-len", "128"]


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"cannot run the browser test: {CHROMIUM} is missing (apt-get install -y chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("cannot run the browser test: the package playwright is missing (pip install -e '.[test]')")

    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def plain(smol4_path):
    # Activations past 1 KiB come as download handles: this server's page fetches them, the other's reads them inline.
    with vlens_serve(["--model", str(smol4_path), *SERVE, "--inline-activation-bytes", "1024"]) as (url, _):
        yield url


@pytest.fixture(scope="module")
def sae_path(tmp_path_factory):
    return save_saelens(tmp_path_factory.mktemp("lens-sae") / "sae", d_sae=64, seed=3, hook=SAE_HOOK)[0]


@pytest.fixture(scope="module")
def tuned_path(tmp_path_factory):
    """A tuned lens for the 4-layer SmolLM2 (d 576) as the tuned-lens package saves one, random translators."""
    path = tmp_path_factory.mktemp("tuned")
    g = torch.Generator().manual_seed(7)
    state = {f"{i}.{name}": torch.randn(shape, generator=g) * 0.05 for i in range(4)
             for name, shape in (("weight", (576, 576)), ("bias", (576,)))}  # fmt: skip
    torch.save(state, path / "params.pt")
    (path / "config.json").write_text(json.dumps({"base_model_name_or_path": "smol4", "d_model": 576,
                                                  "num_hidden_layers": 4, "bias": True}))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def with_sae(smol4_path, sae_path, tuned_path, tmp_path_factory):
    vector = tmp_path_factory.mktemp("steering") / "kind.safetensors"
    g = torch.Generator().manual_seed(5)
    SteeringVector({"blocks.1.hook_resid_post": torch.randn(576, generator=g)}).save(vector)
    args = ["--model", str(smol4_path), *SERVE, "--sae", f"feat={sae_path}", "--tuned-lens", str(tuned_path),
            "--steering-vector", f"kind={vector}"]  # fmt: skip
    with vlens_serve(args, env={"VLENS_API_KEY": KEY}) as (url, _):
        yield url


class Visit:
    """A fresh browser tab on a page, recording every request it makes and refusing those that would leave
    the machine."""

    def __init__(self, browser, url: str, base: str):
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.context.on("request", lambda r: self.requests.append(r.url))
        self.context.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)
        self.base = base

    def cells(self, selector: str) -> list[dict[str, str]]:
        return self.page.eval_on_selector_all(selector, "els => els.map(e => ({...e.dataset}))")

    def run(self, prompt: str, max_tokens: int = 0) -> None:
        self.page.fill("#prompt", prompt)
        self.page.fill("#max-tokens", str(max_tokens))
        self.page.click("#run")
        self.page.wait_for_function("() => ['Done.', ''].includes(document.getElementById('status').textContent)")

    def close(self, screenshot: Path) -> None:
        self.page.screenshot(path=str(screenshot), full_page=True)
        self.context.close()
        assert not self.errors, self.errors
        assert self.requests and all(u.startswith(self.base) for u in self.requests), self.requests


def hover(page, row: int, key: int) -> dict[str, str]:
    """Point at cell (query row, key) of the attention canvas, its box scrolled into the window and the cell into
    the middle of the box, and return the tip's data-* with its text and whether it shows."""
    point = page.eval_on_selector("#attention-scroll", """(box, [row, key]) => {
        const [cell, left, top] = [Number(box.dataset.cell), Number(box.dataset.left), Number(box.dataset.top)];
        box.scrollIntoView({block: "nearest"});
        box.scrollLeft = Math.round(key * cell - (box.clientWidth - left) / 2);
        box.scrollTop = Math.round(row * cell - (box.clientHeight - top) / 2);
        const rect = box.getBoundingClientRect();
        const [x, y] = [left + key * cell - box.scrollLeft, top + row * cell - box.scrollTop];  // the cell's corner
        return {x: rect.left + box.clientLeft + x, y: rect.top + box.clientTop + y, cell};
    }""", [row, key])
    page.mouse.move(0, 0)  # (off the box first: a move to where the mouse already is reports nothing)
    page.mouse.move(point["x"] + point["cell"] / 2, point["y"] + point["cell"] / 2)
    return page.eval_on_selector("#attention-tip", "e => ({...e.dataset, text: e.textContent, shown: !e.hidden})")


def complete(
    url: str, prompt, max_tokens: int, vlens: dict | None = None, headers: dict | None = None, model: str | None = None
) -> dict:  # fmt: skip
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "echo": max_tokens == 0}
    if model:
        body["model"] = model
    if vlens:
        body["vlens"] = vlens
    r = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def mean_residual(url: str, text: str, hook: str) -> list[float]:
    capture = {"hooks": hook, "reduce": "mean", "dtype": "float32", "positions": "all"}
    acts = decode_activations(complete(url, text, 0, {"capture": capture})["vlens"]["activations"], url)
    return acts[hook][0].double().tolist()


def check_lens(
    cells: list[dict], url: str, prompt: str, max_tokens: int, headers: dict | None = None, tuned: bool = False,
    model: str | None = None,
) -> list[int]:  # fmt: skip
    """Every heatmap cell is the server's top logit-lens token (`tuned`: through its tuned lens; of `model`) and its
    probability at that layer and position; returns the token ids of the prompt and completion. Within 1e-5: the
    page's request may share its steps with the page's other requests, and a batch of other rows moves float32 sums
    by ~1e-6."""
    capture = {"hooks": "blocks.*.hook_resid_post", "logit_lens": K, "positions": "all", "tuned_lens": tuned}
    response = complete(url, prompt, max_tokens, {"capture": capture}, headers, model)
    acts = decode_activations(response["vlens"]["activations"], url, headers)
    positions = acts["positions"].tolist()
    expected = {}
    for layer in range(4):
        lens = f"blocks.{layer}.hook_resid_post.logit_lens"
        ids, logprobs = acts[f"{lens}.token_ids"], acts[f"{lens}.logprobs"]
        for row, pos in enumerate(positions):
            expected[(layer, pos)] = (int(ids[row, 0]), math.exp(float(logprobs[row, 0])))
    got = {(int(c["layer"]), int(c["pos"])): (int(c["tokenId"]), float(c["prob"])) for c in cells}
    assert got.keys() == expected.keys() and len(got) == 4 * len(positions)
    for key, (token, prob) in expected.items():
        assert got[key][0] == token and math.isclose(got[key][1], prob, rel_tol=1e-5), (key, got[key], token, prob)
    return acts["token_ids"].tolist()


def test_lens_page_shows_the_servers_numbers(plain, browser, smol4, tmp_path_factory):
    visit = Visit(browser, plain + "/lens", plain)
    page = visit.page
    visit.run(PROMPT, max_tokens=3)
    tokens = check_lens(visit.cells("#lens-table td[data-prob]"), plain, PROMPT, 3)
    assert [int(c["tokenId"]) for c in visit.cells("#tokens li")] == tokens
    assert page.is_hidden("#tuned-row") and page.is_hidden("#model-row")  # (no tuned lens, no vector: no choice)
    completion = complete(plain, PROMPT, 3)["choices"][0]["text"]
    assert page.text_content("#completion") == f"Completion: {completion}"
    page.focus("#lens-table td[data-prob] >> nth=0")
    page.keyboard.press("ArrowRight")  # the keyboard moves between cells, each showing its top k
    assert page.locator("#lens-detail li").count() == K and "position 1" in page.text_content("#lens-detail")

    # One head: every query x key weight is hook_pattern's from LLM.trace, in the tip of the cell pointed at.
    page.select_option("#layer", "2")
    page.fill("#head", "4")
    page.click("#attention-show")
    page.wait_for_selector("#attention-canvas[data-layer='2'][data-head='4']")
    # The page reads the prompt and its completion together (so the last generated token too).
    pattern = smol4.trace([tokens], "blocks.2.attn.hook_pattern")[0]["blocks.2.attn.hook_pattern"][:, 4]
    for query in range(len(tokens)):
        for key in range(query + 1):
            tip = hover(page, query, key)
            assert (tip["layer"], tip["head"], tip["query"], tip["key"]) == ("2", "4", str(query), str(key))
            assert abs(float(tip["weight"]) - pattern[query, key].item()) < 1e-5, tip
    # Every head of the layer is a thumbnail; choosing one draws it with no new request.
    assert page.locator("#attention-heads button").count() == 9
    asked = len(visit.requests)
    page.click("#attention-heads button[data-head='8']")
    assert page.get_attribute("#attention-canvas", "data-head") == "8" and page.input_value("#head") == "8"
    assert len(visit.requests) == asked
    page.fill("#head", "")  # no head: the layer's first
    page.click("#attention-show")
    page.wait_for_selector("#attention-canvas[data-head='0']")

    # A head that does not exist: the error beside the field, and no pattern left on screen.
    page.fill("#head", "12")
    page.click("#attention-show")
    page.wait_for_function("() => document.getElementById('head-error').textContent !== ''")
    assert page.text_content("#head-error") == "head 12: this view has heads 0, 1, 2, 3, 4, 5, 6, 7, 8 of layer 2"
    assert page.locator("#attention-heads button").count() == 0 and page.is_hidden("#attention-view")

    # Steering by the difference of two prompts' mean residuals: the page's completions are the API's.
    page.fill("#head", "")
    page.fill("#steer-scale", "6")
    page.fill("#steer-tokens", "8")
    page.click("#steer-run")
    page.wait_for_function("() => document.getElementById('steer-steered').textContent !== ''")
    hook = page.input_value("#steer-hook")
    assert hook == "blocks.2.hook_resid_post" and page.is_hidden("#steer-vector-row")  # (this server has none)
    plus, minus = mean_residual(plain, "I love this", hook), mean_residual(plain, "I hate this", hook)
    vector = [a - b for a, b in zip(plus, minus)]
    steer = {"type": "steer", "hook": hook, "vector": vector, "scale": 6.0}
    steered = complete(plain, PROMPT, 8, {"interventions": [steer]})["choices"][0]["text"]
    assert page.text_content("#steer-plain") == complete(plain, PROMPT, 8)["choices"][0]["text"]
    assert page.text_content("#steer-steered") == steered != page.text_content("#steer-plain")
    visit.page.screenshot(path=str(tmp_path_factory.mktemp("lens") / "lens-plain.png"), full_page=True)

    # Bad input: the server's error beside the prompt, and nothing of the earlier prompt left as if new.
    for prompt, max_tokens, message in [
        ("", 0, "prompt[0]: empty text"),
        (PROMPT, 200, "max_tokens: 200 plus the 5-token prompt exceed this server's context of 128 tokens"),
    ]:
        visit.run(prompt, max_tokens)
        assert message in page.text_content("#prompt-error")
        for selector in ("#tokens li", "#lens-table td", "#attention-heads button", "#steer-steered"):
            assert page.locator(selector).count() == 0 or page.text_content(selector) == "", selector
        assert page.is_hidden("#attention-view")
    page.screenshot(path=str(tmp_path_factory.mktemp("lens") / "lens-error.png"), full_page=True)
    # A slow run overtaken by a quick one: the slow one's answer, arriving last, is not drawn.
    def slow(response) -> bool:
        return response.url.endswith("/v1/completions") and '"max_tokens":40' in (response.request.post_data or "")

    with page.expect_response(slow) as overtaken:
        page.fill("#prompt", "Once upon a time")
        page.fill("#max-tokens", "40")
        page.click("#run")
        visit.run("Paris is a city in", 0)
    overtaken.value.finished()
    page.wait_for_timeout(300)  # the page's handler of that answer has run by now (if it drew, it shows)
    assert page.text_content("#prompt-error") == ""
    tokens = check_lens(visit.cells("#lens-table td[data-prob]"), plain, "Paris is a city in", 0)
    assert [int(c["tokenId"]) for c in visit.cells("#tokens li")] == tokens
    assert any("/v1/activations/act-" in url for url in visit.requests)  # the handles were followed
    visit.close(tmp_path_factory.mktemp("lens") / "lens-errors.png")


def test_lens_page_with_an_sae_and_a_key(with_sae, browser, smol4, tmp_path_factory):
    # The page holds no data, so it needs no key; the token texts it names cells by do.
    page = httpx.get(with_sae + "/lens")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.text and not re.search(r"https?://", page.text)
    assert httpx.post(with_sae + "/lens/texts", json={"tokens": [1]}).status_code == 401
    texts = httpx.post(with_sae + "/lens/texts", json={"tokens": [504, 2115, 28]}, headers=AUTH).json()["texts"]
    assert texts == [smol4.tokenizer.decode([t]) for t in (504, 2115, 28)]
    bad = httpx.post(with_sae + "/lens/texts", json={"tokens": [49152]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"

    visit = Visit(browser, with_sae + "/lens", with_sae)
    page = visit.page
    visit.run(PROMPT)  # no key typed yet: the server's 401, word for word
    assert page.text_content("#prompt-error") == "missing API key: send the header `Authorization: Bearer KEY`"
    page.fill("#api-key", KEY)
    visit.run(PROMPT)
    page.wait_for_selector("#sae-table td[data-feature]")
    ids = check_lens(visit.cells("#lens-table td[data-prob]"), with_sae, PROMPT, 0, AUTH)
    assert [int(c["tokenId"]) for c in visit.cells("#tokens li")] == ids
    untuned = visit.cells("#lens-table td[data-prob]")

    # Each token's top latents are the server's sae_features, those that fired (within 1e-5, as the lens: the
    # page's request shares its steps with the page's attention requests, which moves float32 sums by ~1e-6).
    capture = {"sae": "feat", "top_k": K, "positions": "all"}
    entry = complete(with_sae, ids, 0, {"capture": capture}, AUTH)["vlens"]["sae_features"][SAE_HOOK]
    expected = {
        (pos, f): v for pos, row_ids, row_values in zip(entry["positions"], entry["ids"], entry["values"])
        for f, v in zip(row_ids, row_values) if v > 0
    }  # fmt: skip
    got = {(int(c["pos"]), int(c["feature"])): float(c["value"]) for c in visit.cells("#sae-table td[data-feature]")}
    assert got.keys() == expected.keys() and expected
    assert all(math.isclose(got[key], value, rel_tol=1e-5) for key, value in expected.items()), (got, expected)

    # A latent chosen with the keyboard: its activation at every position, as the server reads it.
    (pos, feature), _ = max(expected.items(), key=lambda item: item[1])
    page.focus(f"#sae-table td[data-pos='{pos}'][data-feature='{feature}']")
    page.keyboard.press("Enter")
    page.wait_for_selector("#sae-strip td[data-value]")
    dense = complete(with_sae, ids, 0, {"capture": {"sae": "feat", "features": [feature], "positions": "all"}}, AUTH)
    strip = dense["vlens"]["sae_features"][SAE_HOOK]
    got = [(int(c["pos"]), int(c["feature"]), float(c["value"])) for c in visit.cells("#sae-strip td[data-feature]")]
    assert got == [(p, feature, row[0]) for p, row in zip(strip["positions"], strip["values"])]

    # Steering along the latent's decoder row: the page's steered completion is the API's, and differs.
    page.check("#steer-by-sae")
    page.fill("#steer-feature", str(feature))
    page.fill("#steer-scale", "30")
    page.fill("#steer-tokens", "8")
    page.click("#steer-run")
    page.wait_for_function("() => document.getElementById('steer-steered').textContent !== ''")
    steer = {"type": "steer", "hook": SAE_HOOK, "sae": "feat", "feature": feature, "scale": 30.0}
    steered = complete(with_sae, PROMPT, 8, {"interventions": [steer]}, AUTH)["choices"][0]["text"]
    assert page.text_content("#steer-plain") == complete(with_sae, PROMPT, 8, headers=AUTH)["choices"][0]["text"]
    assert page.text_content("#steer-steered") == steered != page.text_content("#steer-plain")

    # Steering with a vector the server loaded, the scale its multiplier: the API's completion, and it differs.
    page.check("#steer-by-vector")
    page.select_option("#steer-vector", "kind")
    page.fill("#steer-scale", "12")
    page.evaluate("() => { document.getElementById('steer-steered').textContent = ''; }")
    page.click("#steer-run")
    page.wait_for_function("() => document.getElementById('steer-steered').textContent !== ''")
    steered = complete(with_sae, PROMPT, 8, {"steering": [{"name": "kind", "multiplier": 12.0}]}, AUTH)
    assert page.text_content("#steer-steered") == steered["choices"][0]["text"] != page.text_content("#steer-plain")

    # The server has a tuned lens: the page offers it, and its cells are then the server's tuned-lens numbers.
    page.check("#tuned-lens")
    visit.run(PROMPT)
    page.wait_for_selector("#sae-table td[data-feature]")
    assert page.text_content("#lens-title") == "Tuned lens"
    check_lens(visit.cells("#lens-table td[data-prob]"), with_sae, PROMPT, 0, AUTH, tuned=True)
    assert visit.cells("#lens-table td[data-prob]") != untuned

    # The steering vector as a model: the page's lens is the steered model's, as the API gives it, and moved.
    page.uncheck("#tuned-lens")
    page.select_option("#model", "kind")
    visit.run(PROMPT, max_tokens=3)
    page.wait_for_selector("#sae-table td[data-feature]")
    tokens = check_lens(visit.cells("#lens-table td[data-prob]"), with_sae, PROMPT, 3, AUTH, model="kind")
    assert [int(c["tokenId"]) for c in visit.cells("#tokens li")] == tokens
    assert page.text_content("#model-line") == "Model: kind"
    steered = visit.cells("#lens-table td[data-prob]")
    assert [c for c in steered if int(c["pos"]) < len(ids)] != untuned
    visit.close(tmp_path_factory.mktemp("lens") / "lens-sae.png")


def same_cells(visit: Visit, llm, max_tokens: int, tuned_lens: TunedLens | None = None) -> None:
    """The page's lens cells are the offline engine's (top token and probability at each layer and position)."""
    capture = Capture(hooks="blocks.*.hook_resid_post", logit_lens=K, tuned_lens=tuned_lens)
    [ref] = llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, capture=capture), use_tqdm=False)
    cells = visit.cells("#lens-table td[data-prob]")
    got = {(int(c["layer"]), int(c["pos"])): (int(c["tokenId"]), float(c["prob"])) for c in cells}
    positions = ref.activation_positions.tolist()
    assert len(got) == 4 * len(positions)
    for layer in range(4):
        ids, logprobs = ref.logit_lens[f"blocks.{layer}.hook_resid_post"]
        for row, pos in enumerate(positions):
            token, prob = got[(layer, pos)]
            assert token == ids[row, 0].item() and math.isclose(prob, math.exp(logprobs[row, 0].item()), rel_tol=1e-6)
    assert visit.page.text_content("#lens-title") == ("Logit lens" if tuned_lens is None else "Tuned lens")


def test_lens_file_renders_offline(browser, smol4, smol4_path, sae_path, tuned_path, tmp_path):
    """`vlens lens` writes one file that the browser draws with no request at all: the same cells, the
    numbers of the offline engine (through a tuned lens too)."""
    out = tmp_path / "lens.html"
    args = ["lens", PROMPT, "--model", str(smol4_path), "--max-tokens", "2", "--sae", str(sae_path), "--out", str(out)]
    assert main(args) == 0
    visit = Visit(browser, out.as_uri(), out.as_uri())
    same_cells(visit, smol4, 2)
    assert visit.page.locator("#attention-heads button").count() == 9  # layer 0, every head
    assert visit.page.get_attribute("#attention-canvas", "data-layer") == "0"
    assert visit.page.locator("#sae-table td[data-feature]").count() > 0
    assert len(visit.requests) == 1  # the file itself, nothing else
    visit.close(tmp_path / "lens-file.png")
    tuned = tmp_path / "tuned.html"
    args = ["lens", PROMPT, "--model", str(smol4_path), "--attention-layers", "0", "--tuned-lens", str(tuned_path),
            "--out", str(tuned)]  # fmt: skip
    assert main(args) == 0
    visit = Visit(browser, tuned.as_uri(), tuned.as_uri())
    same_cells(visit, smol4, 0, TunedLens.load(tuned_path))
    visit.close(tmp_path / "tuned-file.png")


def shade(weight: float) -> list[int]:
    """The page's colour of a weight: hsl(212, 75%, 98% - 68% * weight), as RGB."""
    return [round(255 * c) for c in colorsys.hls_to_rgb(212 / 360, 0.98 - 0.68 * weight, 0.75)]


def test_long_prompt_draws_one_head_at_a_time(browser, smol4, tmp_path):
    """320 tokens, 9 heads (460k weights): the page draws the chosen head's cells in sight on a canvas, its
    heads as thumbnails, and each cell pointed at (anywhere, after scrolling) names its tokens and weight."""
    ids = [(i * 7919) % 40000 + 100 for i in range(320)]
    capture = Capture(hooks="blocks.1.attn.hook_pattern", dtype="float32")
    [out] = smol4.generate([ids], SamplingParams(max_tokens=0, capture=capture), use_tqdm=False)
    pattern = out.activations["blocks.1.attn.hook_pattern"]  # [queries, heads, keys]
    path = viz.attention(out, 1, tokenizer=smol4.tokenizer).save(tmp_path / "long.html")
    start = time.perf_counter()
    visit = Visit(browser, path.as_uri(), path.as_uri())
    page = visit.page
    page.wait_for_selector("#attention-canvas[data-head='0']")
    page.evaluate("() => new Promise((done) => requestAnimationFrame(() => setTimeout(done)))")  # (painted)
    print(f"\n320 tokens x 9 heads: {path.stat().st_size / 1e6:.1f} MB, drawn in {time.perf_counter() - start:.2f} s")
    assert page.locator("#attention-section td").count() == 0  # no cell is an element
    assert page.locator("#attention-heads button").count() == 9
    assert page.get_attribute("#attention-heads button[data-head='0']", "aria-pressed") == "true"
    assert page.text_content("#attention-caption") == "Layer 1, head 0: 320 queries by 320 keys"
    tokens = page.eval_on_selector_all("#tokens li", "els => els.map(e => e.textContent)")

    def check(head: int, query: int, key: int) -> None:
        tip = hover(page, query, key)
        w = pattern[query, head, key].item()
        assert tip["shown"] and [tip["layer"], tip["head"], tip["query"], tip["key"]] == list(map(str, [1, head, query, key]))
        assert float(tip["weight"]) == w  # the captured float32, exactly
        lines = tip["text"].split("\n")
        assert lines[:3] == [f"layer 1, head {head}", f"query {query} {tokens[query]}", f"key   {key} {tokens[key]}"]
        shown = float(lines[3].removeprefix("weight "))  # 4 significant digits
        assert abs(shown - w) <= 0.5 * 10 ** (math.floor(math.log10(w)) - 3), (lines, w)
        corner = page.eval_on_selector("#attention-canvas", """(canvas, [query, key]) => {
            const box = document.getElementById("attention-scroll");
            const x = Number(box.dataset.left) + key * Number(box.dataset.cell) - box.scrollLeft + 3;
            const y = Number(box.dataset.top) + query * Number(box.dataset.cell) - box.scrollTop + 3;
            return Array.from(canvas.getContext("2d").getImageData(x, y, 1, 1).data.slice(0, 3));
        }""", [query, key])  # the cell's own pixels, drawn for this scroll position
        assert all(abs(a - b) <= 1 for a, b in zip(corner, shade(w))), (corner, shade(w), w)

    for query, key in [(7, 3), (319, 319), (300, 150), (160, 0)]:
        check(0, query, key)
    masked = hover(page, 5, 10)
    assert masked["key"] == "10" and "weight" not in masked
    assert masked["text"].endswith("masked: the key is after the query")

    # Another head: by its thumbnail, then by the form; a head the layer lacks is refused by name.
    page.click("#attention-heads button[data-head='5']")
    assert page.get_attribute("#attention-heads button[data-head='5']", "aria-pressed") == "true"
    assert page.text_content("#attention-caption").startswith("Layer 1, head 5:")
    assert page.get_attribute("#attention-heads button[data-head='0']", "aria-pressed") == "false"
    check(5, 300, 150)
    page.fill("#head", "8")
    page.click("#attention-show")
    page.wait_for_selector("#attention-canvas[data-head='8']")
    check(8, 250, 249)

    # The keyboard: focus the pattern, move from its first cell; the box scrolls to keep the cell in sight.
    page.mouse.move(0, 0)
    page.eval_on_selector("#attention-scroll", "box => { box.scrollLeft = 0; box.scrollTop = 0; }")
    page.focus("#attention-scroll")
    for key in ["ArrowDown", "ArrowDown", "ArrowRight", "ArrowRight", "ArrowRight"]:
        page.keyboard.press(key)  # (right stops at the query's own position: 2)
    tip = page.eval_on_selector("#attention-tip", "e => ({...e.dataset})")
    assert (tip["query"], tip["key"], float(tip["weight"])) == ("2", "2", pattern[2, 8, 2].item())
    for _ in range(30):
        page.keyboard.press("PageDown")
    page.keyboard.press("End")
    tip = page.eval_on_selector("#attention-tip", "e => ({...e.dataset, shown: !e.hidden})")
    assert tip["shown"] and (tip["query"], tip["key"]) == ("302", "302")
    assert float(tip["weight"]) == pattern[302, 8, 302].item()
    assert page.eval_on_selector("#attention-scroll", "box => box.scrollTop") > 0

    page.fill("#head", "9")
    page.click("#attention-show")
    assert page.text_content("#head-error") == "head 9: this view has heads 0, 1, 2, 3, 4, 5, 6, 7, 8 of layer 1"
    assert page.is_hidden("#attention-view")
    visit.close(tmp_path / "long.png")


def static_page(browser, tmp_path: Path, texts: dict[str, str], hooks: list[str]) -> Visit:
    """The offline page of a made-up payload (no model): tokens 0..n-1 named by `texts`, a logit lens at `hooks`
    whose every cell names its own position's token."""
    n = len(texts)
    layers = [{"layer": int(hook.split(".")[1]), "hook": hook, "positions": list(range(n)),
               "ids": [[i] for i in range(n)], "logprobs": [[-0.5]] * n} for hook in hooks]  # fmt: skip
    payload = {"model": None, "prompt": None, "token_ids": list(range(n)), "prompt_tokens": n, "completion": None,
               "texts": texts, "lens": {"k": 1, "layers": layers}, "attention": [], "sae": None,
               "feature": None}  # fmt: skip
    path = tmp_path / "page.html"
    path.write_text(viz.page_html(payload), encoding="utf-8")
    return Visit(browser, path.as_uri(), path.as_uri())


def test_blank_and_control_characters_in_tokens_show(browser, tmp_path):
    """A token of "\\r" (SmolLM2 has 31 tokens holding one) or a no-break space shows as its code point, never
    as an empty box or as the "\\n" it precedes; markup in a token is text."""
    texts = {"0": "\r\n", "1": "\xa0", "2": " a\tb", "3": "<b>x</b>\x0c"}
    visit = static_page(browser, tmp_path, texts, ["blocks.0.hook_resid_post"])
    shown = ["\\u000d\u21b5", "\\u00a0", "\u2423a\u21e5b", "<b>x</b>\\u000c"]
    assert visit.page.eval_on_selector_all("#tokens li", "els => els.map(e => e.textContent)") == shown
    assert visit.page.eval_on_selector_all("#lens-table .tok", "els => els.map(e => e.textContent)") == shown
    assert visit.page.locator("b").count() == 0
    visit.close(tmp_path / "blank-tokens.png")


def test_lens_rows_at_several_hooks_of_a_layer_are_named_apart(browser, tmp_path):
    """viz.logit_lens of Capture(hooks=["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"], logit_lens=k)."""
    hooks = ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.1.hook_resid_mid", "blocks.1.hook_resid_post"]
    visit = static_page(browser, tmp_path, {"0": "a"}, hooks)
    rows = visit.page.eval_on_selector_all("#lens-table th[scope=row]", "els => els.map(e => e.textContent)")
    assert rows == ["L0 hook_resid_pre", "L0", "L1 hook_resid_mid", "L1"]
    visit.close(tmp_path / "lens-rows.png")
