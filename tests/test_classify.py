"""Sequence classifiers (HF's *ForSequenceClassification, vLLM's LLM.classify and /classify): tiny random checkpoints of
seven families (a multimodal checkpoint's text model and a hybrid of linear attention among them), their class
probabilities for prompts of several lengths packed in one batch equal to HF's, one prompt at a time; under a steer,
equal to HF's under the same addition by a forward hook; the server's /classify equal to LLM.classify; two ranks'
classes as one process's; a classifier's taps as any model's (HookedLM's too); what would read token logits refused
by name before any work; probabilities after the config's problem_type, as vLLM's; a one-class classifier as a
cross-encoder (LLM.score, /score, /rerank) scoring pairs as HF's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
from conftest import rel_err
from server_helpers import running_server
from transformers import (
    Gemma3Config,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3_5TextConfig,
)

from vlens import LLM, Capture, HookedLM, SamplingParams, Steer
from vlens.server.config import ServerConfig

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SIZES = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                     patch_size=8)  # fmt: skip
CONFIGS = {  # HF's classifier -> its config (pad_token_id: HF's classifiers find a prompt's last token by it)
    "LlamaForSequenceClassification": LlamaConfig(**SIZES, num_key_value_heads=2),
    "Qwen2ForSequenceClassification": Qwen2Config(**SIZES, num_key_value_heads=2),
    "GemmaForSequenceClassification": GemmaConfig(**SIZES, num_key_value_heads=1, head_dim=16),
    "GPT2ForSequenceClassification": GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "GPTNeoXForSequenceClassification": GPTNeoXConfig(**SIZES),
    # (a multimodal checkpoint's text model; a hybrid of linear and full attention layers)
    "Gemma3ForSequenceClassification": Gemma3Config(text_config=SIZES | dict(num_key_value_heads=1, head_dim=16),
                                                    vision_config=GEMMA3_VISION, mm_tokens_per_image=4),
    "Qwen3_5TextForSequenceClassification": Qwen3_5TextConfig(**SIZES | dict(num_hidden_layers=4), head_dim=16,
                                                              num_key_value_heads=1),
}
LLAMA = "LlamaForSequenceClassification"
PROMPTS = [[5, 17, 33, 2, 9, 101, 4], [44], [7, 7, 190, 3]]


def _classifier(name: str, path) -> torch.nn.Module:
    """Random weights for HF's classifier `name` as a three-class one, saved like a real checkpoint; HF's model."""
    config = CONFIGS[name]
    config.num_labels, config.id2label, config.label2id = 3, LABELS, {v: k for k, v in LABELS.items()}
    config.pad_token_id = 0
    return _saved(getattr(transformers, name), config, path)


def _saved(cls: type, config, path, scale: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():  # (HF starts the head at a small scale: probabilities near uniform would test little)
        hf.score.weight.normal_(0, scale)
    hf.save_pretrained(path)
    return hf


def _hf_probs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().softmax(-1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[LLM, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama_classifier")
    hf = _classifier(LLAMA, path)
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20), hf


@pytest.mark.parametrize("name", CONFIGS)
def test_probabilities_equal_hf(name, tmp_path):
    hf = _classifier(name, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=64 << 20)  # (Qwen 3.5's states)
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    for ids, out in zip(PROMPTS, outputs, strict=True):
        want = _hf_probs(hf, ids)
        probs = torch.tensor(out.outputs.probs)
        assert out.prompt_token_ids == ids and out.outputs.num_classes == 3
        assert rel_err(probs, want) < 1e-5 and out.outputs.label == LABELS[int(want.argmax())]
        assert torch.allclose(torch.tensor(out.outputs.logits).softmax(-1), probs, atol=1e-6)
    assert len({out.outputs.label for out in outputs}) > 1  # (the prompts are told apart)


@pytest.mark.parametrize(
    "labels, problem_type, activation",
    [({0: "score"}, None, torch.sigmoid),  # (a reward model: one logit, its score)
     ({0: "a", 1: "b"}, "multi_label_classification", torch.sigmoid),
     ({0: "x", 1: "y"}, "regression", lambda z: z)],
)  # fmt: skip
def test_probabilities_follow_the_problem_type_as_vllms(labels, problem_type, activation, tmp_path):
    """vLLM's activations: a sigmoid for one class or for multi-label ones, none for a regression; the logits are
    HF's either way."""
    config = LlamaConfig(**SIZES, num_key_value_heads=2, num_labels=len(labels), id2label=labels, pad_token_id=0,
                         label2id={v: k for k, v in labels.items()}, problem_type=problem_type)  # fmt: skip
    hf = _saved(transformers.LlamaForSequenceClassification, config, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    for ids, out in zip(PROMPTS, llm.classify(PROMPTS, use_tqdm=False), strict=True):
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0]
        assert rel_err(torch.tensor(out.outputs.logits), logits) < 1e-5
        assert rel_err(torch.tensor(out.outputs.probs), activation(logits)) < 1e-5
        assert out.outputs.label == labels[int(activation(logits).argmax())]


def test_steered_classes_equal_hf_under_the_same_addition(llama):
    """A steer on a layer's output moves the classes as the same vector added by a forward hook moves HF's."""
    llm, hf = llama
    vector = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 4
    steered = llm.classify(PROMPTS, use_tqdm=False, interventions=[Steer("blocks.0.hook_resid_post", vector)])
    handle = hf.model.layers[0].register_forward_hook(lambda m, a, out: out + vector)
    try:
        for ids, out in zip(PROMPTS, steered, strict=True):
            assert rel_err(torch.tensor(out.outputs.probs), _hf_probs(hf, ids)) < 1e-5
    finally:
        handle.remove()
    plain = llm.classify(PROMPTS, use_tqdm=False)
    assert all(rel_err(torch.tensor(p.outputs.probs), torch.tensor(s.outputs.probs)) > 1e-3
               for p, s in zip(plain, steered))  # fmt: skip


def test_a_classifiers_taps_are_a_causal_lms(llama):
    llm, hf = llama
    hook = "blocks.0.hook_resid_post"  # (HF's hidden_states[1]; its last is past the final norm)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=0, capture=Capture(hook)), use_tqdm=False)
    with torch.inference_mode():
        hidden = hf(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    assert rel_err(out.activations[hook], hidden[1][0]) < 1e-5


@pytest.mark.parametrize(
    "call, message",
    [(lambda llm: llm.generate(PROMPTS, use_tqdm=False), "^max_tokens: LlamaForSequenceClassification: a classifier has "
                                                         "no token logits; its classes come from LLM.classify"),
     (lambda llm: llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False),
      "^prompt_logprobs: LlamaForSequenceClassification"),
     (lambda llm: llm.generate(PROMPTS, SamplingParams(max_tokens=0, capture=Capture(
         "blocks.0.hook_resid_post", logit_lens=3)), use_tqdm=False), "^capture.logit_lens: LlamaForSequenceClass"),
     (lambda llm: llm.trace(PROMPTS, "unembed.hook_out"), "'unembed.hook_out' matches no hook")],
)  # fmt: skip
def test_what_reads_token_logits_is_refused_before_any_work(llama, call, message):
    llm, _ = llama
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert not llm.engine.has_work()


def test_hooked_lm_runs_a_classifier_without_token_logits(llama, tmp_path):
    llm, _ = llama
    path = tmp_path / "hooked"
    _classifier(LLAMA, path)
    model = HookedLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match="^return_type: LlamaForSequenceClassification: a classifier has no token"):
        model(torch.tensor([PROMPTS[0]]))
    _, cache = model.run_with_cache(torch.tensor([PROMPTS[0]]), return_type=None, names_filter="ln_final.hook_out")
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=0, capture=Capture("ln_final.hook_out")),
                         use_tqdm=False)  # fmt: skip
    assert rel_err(cache["ln_final.hook_out"][0], out.activations["ln_final.hook_out"]) < 1e-6


def test_two_ranks_classify_as_one(llama, tmp_path):
    """Under tensor parallelism the head, on rank 0, reads the rows the ranks' decoder computed together (the last
    one, or every one: LLM.reward)."""
    llm, _ = llama
    path = tmp_path / "ranks"
    _classifier(LLAMA, path)
    with LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, tensor_parallel_size=2) as two:
        for a, b in zip(llm.classify(PROMPTS, use_tqdm=False), two.classify(PROMPTS, use_tqdm=False), strict=True):
            assert rel_err(torch.tensor(b.outputs.probs), torch.tensor(a.outputs.probs)) < 1e-5
        for a, b in zip(llm.reward(PROMPTS, use_tqdm=False), two.reward(PROMPTS, use_tqdm=False), strict=True):
            assert b.outputs.data.shape == (len(b.prompt_token_ids), 3) and rel_err(b.outputs.data, a.outputs.data) < 1e-5


def test_a_causal_lm_has_no_classes(smol4):
    with pytest.raises(ValueError, match=r"^classify: LlamaForCausalLM is a causal LM, without the head \(score\)"):
        smol4.classify("Hi", use_tqdm=False)


def test_the_servers_classify_equals_llm_classify(llama, tmp_path):
    llm, hf = llama
    path = tmp_path / "served"
    _classifier(LLAMA, path)
    offline = llm.classify(PROMPTS, use_tqdm=False)
    served = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    with running_server(served, ServerConfig(served_model_name="judge")) as url:
        r = httpx.post(url + "/classify", json={"model": "judge", "input": PROMPTS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == "judge"
        assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS)) and body["usage"]["completion_tokens"] == 0
        for i, (d, o) in enumerate(zip(body["data"], offline, strict=True)):
            assert (d["index"], d["label"], d["num_classes"]) == (i, o.outputs.label, 3)
            assert rel_err(torch.tensor(d["logits"]), torch.tensor(o.outputs.logits)) < 1e-6
            assert rel_err(torch.tensor(d["probs"]), torch.tensor(o.outputs.probs)) < 1e-6
        one = httpx.post(url + "/classify", json={"input": PROMPTS[1]}, timeout=60).json()["data"]
        assert len(one) == 1 and rel_err(torch.tensor(one[0]["probs"]), torch.tensor(body["data"][1]["probs"])) < 1e-5
        completion = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=60)
        assert completion.status_code == 400 and completion.json()["error"]["param"] == "max_tokens", completion.text
        bad = httpx.post(url + "/classify", json={"input": PROMPTS, "truncate_prompt_tokens": 0}, timeout=60)
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "truncate_prompt_tokens", bad.text


def test_a_causal_lms_server_refuses_classify(served_smol):
    with running_server(served_smol, ServerConfig(served_model_name="smol")) as url:
        r = httpx.post(url + "/classify", json={"input": "Hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "causal LM" in r.text, r.text


# -- cross-encoders: a classifier of one class scoring pairs of texts (vLLM's LLM.score, /score, /rerank) -----------

QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "Paris is the capital of France.", "Cats sleep a lot.",
             "France's capital city is Paris, on the Seine."]  # fmt: skip


@pytest.fixture(scope="module")
def reranker(smol_path, tmp_path_factory) -> tuple[Path, torch.nn.Module, Any]:
    """A one-class Llama classifier over SmolLM2's tokenizer (its vocabulary), saved with it."""
    path = tmp_path_factory.mktemp("reranker")
    config = LlamaConfig(**SIZES | dict(vocab_size=49152), num_key_value_heads=2, num_labels=1, id2label={0: "score"},
                         pad_token_id=0)  # fmt: skip
    hf = _saved(transformers.LlamaForSequenceClassification, config, path, scale=0.1)  # (sigmoids short of 0 or 1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smol_path / name, path / name)
    return path, hf, transformers.AutoTokenizer.from_pretrained(path)


def _hf_score(hf, tokenizer, a: str, b: str) -> float:
    with torch.inference_mode():
        return torch.sigmoid(hf(torch.tensor([tokenizer(a, b)["input_ids"]])).logits[0, 0]).item()


def test_llm_score_pairs_texts_as_hf_and_classify_chat_reads_conversations(reranker):
    path, hf, tokenizer = reranker
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    one_to_many = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    item_by_item = llm.score([QUERY, DOCUMENTS[0]], DOCUMENTS[:2], use_tqdm=False)
    for out, (a, b) in zip(one_to_many + item_by_item, [(QUERY, d) for d in DOCUMENTS] +
                           [(QUERY, DOCUMENTS[0]), (DOCUMENTS[0], DOCUMENTS[1])], strict=True):  # fmt: skip
        assert out.prompt_token_ids == tokenizer(a, b)["input_ids"]
        assert abs(out.outputs.score - _hf_score(hf, tokenizer, a, b)) < 1e-6
    assert len({round(o.outputs.score, 4) for o in one_to_many}) == len(DOCUMENTS)
    # a reward model's reading of a whole conversation: rendered by the template, no generation prompt unless asked
    chat = [{"role": "user", "content": QUERY}, {"role": "assistant", "content": DOCUMENTS[1]}]
    for opened in (False, True):
        [out] = llm.classify_chat(chat, use_tqdm=False, add_generation_prompt=opened)
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=opened)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            logit = hf(torch.tensor([ids])).logits[0, 0].item()
        assert out.prompt_token_ids == ids and abs(out.outputs.logits[0] - logit) < 1e-5
    for args, message in [((QUERY, []), "^data_2: expected a non-empty text"),
                          (([QUERY, QUERY], DOCUMENTS), "^data_2: 4 texts for data_1's 2")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.score(*args)


def test_only_a_one_class_classifier_scores(llama, smol4):
    with pytest.raises(ValueError, match="^score: .*LlamaForSequenceClassification has 3 classes"):
        llama[0].score(QUERY, DOCUMENTS)
    with pytest.raises(ValueError, match="^score: .*LlamaForCausalLM is a causal LM"):
        smol4.score(QUERY, DOCUMENTS)


def test_the_servers_score_rerank_and_chat_classify_equal_hf(reranker, llama):
    path, hf, tokenizer = reranker
    offline = [_hf_score(hf, tokenizer, QUERY, d) for d in DOCUMENTS]
    served = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    with running_server(served, ServerConfig(served_model_name="ranker")) as url:
        for route in ("/score", "/v1/score"):
            body = httpx.post(url + route, json={"model": "ranker", "text_1": QUERY, "text_2": DOCUMENTS},
                              timeout=60).json()  # fmt: skip
            assert body["object"] == "list" and body["id"].startswith("score-") and body["model"] == "ranker"
            assert [d["index"] for d in body["data"]] == list(range(4)) and body["usage"]["completion_tokens"] == 0
            assert all(abs(d["score"] - want) < 1e-6 for d, want in zip(body["data"], offline, strict=True))
        ranked = sorted(range(4), key=lambda i: -offline[i])
        for route in ("/rerank", "/v1/rerank"):
            body = httpx.post(url + route, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3},
                              timeout=60).json()  # fmt: skip
            assert [r["index"] for r in body["results"]] == ranked[:3] and body["id"].startswith("rerank-")
            assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in ranked[:3]]
            assert all(abs(r["relevance_score"] - offline[r["index"]]) < 1e-6 for r in body["results"])
        bare = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS, "return_documents": False},
                          timeout=60).json()["results"]  # fmt: skip
        assert len(bare) == 4 and "document" not in bare[0]
        # /classify's chat form: a whole conversation through the template (a reward model's reading of it)
        chat = [{"role": "user", "content": QUERY}, {"role": "assistant", "content": DOCUMENTS[1]}]
        ids = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            logit = hf(torch.tensor([ids])).logits[0, 0].item()
        [d] = httpx.post(url + "/classify", json={"messages": chat}, timeout=60).json()["data"]
        assert abs(d["logits"][0] - logit) < 1e-5 and abs(d["probs"][0] - torch.sigmoid(torch.tensor(logit))) < 1e-6
        raw = httpx.post(url + "/classify", json={"messages": chat, "use_activation": False}, timeout=60).json()
        assert raw["data"][0]["probs"] == raw["data"][0]["logits"] and raw["usage"]["prompt_tokens"] == len(ids)
        both = httpx.post(url + "/classify", json={"messages": chat, "input": "x"}, timeout=60)
        assert both.status_code == 400 and both.json()["error"]["param"] == "input", both.text
        for route, fields, param in [("/score", {"text_1": [QUERY] * 2, "text_2": DOCUMENTS}, "text_2"),
                                     ("/score", {"text_1": QUERY, "text_2": []}, "text_2")]:  # fmt: skip
            r = httpx.post(url + route, json=fields, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with running_server(llama[0], ServerConfig()) as url:
        r = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "3 classes" in r.text, r.text
