"""vLLM's pooling tasks (LLM.encode, LLM.reward): a causal LM's per-token last hidden states ("token_embed") and its
last one ("embed"), each of unit length unless asked otherwise, equal to HF's final hidden states; a reward model's
(a sequence classifier's) head at every prompt token ("token_classify", LLM.reward) and at the last ("classify")
equal to HF's head on its hidden states, with and without the activation, also under a steer; a token classifier's
(*ForTokenClassification) classes at every token equal to HF's; a base model's checkpoint (HF's *Model, an embedding
model's) read as HF's last hidden states, pooled and normalised as its sentence-transformers modules say, and scoring
pairs of texts as a bi-encoder; the server's /pooling equal to LLM.encode (and to HF); every refusal naming
its field before any work."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
import transformers
from conftest import rel_err
from server_helpers import running_server
from test_classify import LABELS, PROMPTS, SIZES, _saved
from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

from vlens import LLM, Capture, HookedLM, PoolingParams, PoolingRequestOutput, SamplingParams, Steer
from vlens.server.config import ServerConfig

TEXTS = ["The capital of France is", "Hi", "Activations, at every token of a prompt, as vLLM users read them."]
normalize = torch.nn.functional.normalize


@pytest.fixture(scope="module")
def hf_last_hidden(smol4_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smol4_path, dtype=torch.float32).eval()

    def last_hidden(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():  # (transformers 5: the last hidden state is past the final norm)
            return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]

    return last_hidden


def test_token_embed_and_embed_are_hfs_last_hidden_states(smol4, hf_last_hidden):
    """Prompts of several lengths packed in one batch, each against HF alone: every token's row (unit length by
    default, vLLM's), and the last one."""
    tokens = smol4.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    raw = smol4.encode(TEXTS, PoolingParams(normalize=False), pooling_task="token_embed", use_tqdm=False)
    last = smol4.encode(TEXTS, pooling_task="embed", use_tqdm=False)
    last_raw = smol4.encode(TEXTS, PoolingParams(normalize=False), pooling_task="embed", use_tqdm=False)
    for t, r, e, er in zip(tokens, raw, last, last_raw, strict=True):
        assert isinstance(t, PoolingRequestOutput) and t.prompt_token_ids == r.prompt_token_ids == e.prompt_token_ids
        want = hf_last_hidden(t.prompt_token_ids)
        assert t.outputs.data.shape == (len(t.prompt_token_ids), 576) and t.outputs.data.dtype == torch.float32
        assert rel_err(r.outputs.data, want) < 1e-5 and rel_err(t.outputs.data, normalize(want, dim=-1)) < 1e-5
        assert e.outputs.data.shape == (576,) and rel_err(e.outputs.data, normalize(want[-1], dim=0)) < 1e-5
        assert rel_err(er.outputs.data, want[-1]) < 1e-5


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> tuple[LLM, torch.nn.Module]:
    """A one-class Llama classifier (a reward model: its score is its logit) with random weights."""
    path = tmp_path_factory.mktemp("reward_model")
    config = LlamaConfig(**SIZES, num_key_value_heads=2, num_labels=1, id2label={0: "score"}, pad_token_id=0)
    hf = _saved(transformers.LlamaForSequenceClassification, config, path)
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20), hf


def _hf_token_logits(hf, ids: list[int]) -> torch.Tensor:
    """HF's head on every token's hidden state (its classifier pools the last of them)."""
    with torch.inference_mode():
        return hf.score(hf.model(torch.tensor([ids])).last_hidden_state)[0]


def test_reward_is_the_heads_score_at_every_token_as_hfs(reward_model):
    """LLM.reward (token_classify): [tokens, 1], the sigmoid of HF's head at each token (vLLM's activation for one
    class) or, without the activation, the scores themselves; its last row is classify's."""
    llm, hf = reward_model
    rewards = llm.reward(PROMPTS, use_tqdm=False)
    scores = llm.reward(PROMPTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    classified = llm.encode(PROMPTS, pooling_task="classify", use_tqdm=False)
    for ids, r, s, c in zip(PROMPTS, rewards, scores, classified, strict=True):
        want = _hf_token_logits(hf, ids)
        assert r.outputs.data.shape == (len(ids), 1) and r.prompt_token_ids == ids
        assert rel_err(s.outputs.data, want) < 1e-5 and rel_err(r.outputs.data, torch.sigmoid(want)) < 1e-5
        assert rel_err(c.outputs.data, torch.sigmoid(want[-1])) < 1e-5
        with torch.inference_mode():
            assert rel_err(s.outputs.data[-1], hf(torch.tensor([ids])).logits[0]) < 1e-5  # (HF's classifier)
    assert len({round(x, 4) for x in scores[0].outputs.data[:, 0].tolist()}) == len(PROMPTS[0])  # (tokens told apart)


def test_embed_and_classify_take_vllms_pooling_params(reward_model, smol4, hf_last_hidden):
    """vLLM's `pooling_params=` on LLM.embed (normalize) and LLM.classify (use_activation=False: probs are the
    logits)."""
    llm, hf = reward_model
    raw = llm.classify(PROMPTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    for ids, out in zip(PROMPTS, raw, strict=True):
        with torch.inference_mode():
            logit = hf(torch.tensor([ids])).logits[0]
        assert out.outputs.probs == out.outputs.logits and rel_err(torch.tensor(out.outputs.probs), logit) < 1e-5
    [unit] = smol4.embed(TEXTS[:1], pooling="last", pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    assert rel_err(unit.outputs.embedding, normalize(hf_last_hidden(unit.prompt_token_ids)[-1], dim=0)) < 1e-5
    with pytest.raises(ValueError, match="^normalize: give it once"):
        smol4.embed(TEXTS, normalize=True, pooling_params=PoolingParams(normalize=True))
    with pytest.raises(ValueError, match="^pooling_params.use_activation: 'embed' does not read it"):
        smol4.embed(TEXTS, pooling_params=PoolingParams(use_activation=True))
    with pytest.raises(ValueError, match="^pooling_params.normalize: 'classify' does not read it"):
        llm.classify(PROMPTS, pooling_params=PoolingParams(normalize=True))


def test_a_steered_reward_is_hfs_under_the_same_addition(reward_model):
    llm, hf = reward_model
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 4
    steer = Steer("blocks.0.hook_resid_post", vector)
    steered = llm.reward(PROMPTS, pooling_params=PoolingParams(use_activation=False), interventions=[steer],
                         use_tqdm=False)  # fmt: skip
    handle = hf.model.layers[0].register_forward_hook(lambda m, a, out: out + vector)
    try:
        for ids, out in zip(PROMPTS, steered, strict=True):
            assert rel_err(out.outputs.data, _hf_token_logits(hf, ids)) < 1e-5
    finally:
        handle.remove()
    assert rel_err(steered[0].outputs.data, _hf_token_logits(hf, PROMPTS[0])) > 1e-3


def test_token_classify_gives_each_tokens_classes(tmp_path):
    """A three-class classifier at every token: the softmax of HF's head, per token."""
    config = LlamaConfig(**SIZES, num_key_value_heads=2, num_labels=3, id2label=LABELS, pad_token_id=0)
    hf = _saved(transformers.LlamaForSequenceClassification, config, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    for ids, out in zip(PROMPTS, llm.encode(PROMPTS, pooling_task="token_classify", use_tqdm=False), strict=True):
        assert out.outputs.data.shape == (len(ids), 3)
        assert rel_err(out.outputs.data, _hf_token_logits(hf, ids).softmax(-1)) < 1e-5


@pytest.mark.parametrize(
    "name, config",
    [("LlamaForTokenClassification", LlamaConfig(**SIZES, num_key_value_heads=2)),  # (its head: score, with a bias)
     ("GPTNeoXForTokenClassification", GPTNeoXConfig(**SIZES))],  # (its head: classifier)
)  # fmt: skip
def test_a_token_classifiers_classes_at_every_token_are_hfs(name, config, tmp_path):
    """HF's token classifiers: the head on every token's last hidden state, softmax'd; classify, which reads a whole
    prompt, refused naming the task that reads it."""
    config.num_labels, config.id2label, config.pad_token_id = 3, LABELS, 0
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config).eval()
    head = hf.score if hasattr(hf, "score") else hf.classifier
    with torch.no_grad():
        head.weight.normal_(0, 1)
        head.bias.normal_(0, 1)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    for ids, out in zip(PROMPTS, llm.encode(PROMPTS, pooling_task="token_classify", use_tqdm=False), strict=True):
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0]
        assert out.outputs.data.shape == (len(ids), 3) and rel_err(out.outputs.data, want.softmax(-1)) < 1e-5
    with pytest.raises(ValueError, match=f"^pooling_task: 'classify' reads a whole prompt; {name} classifies every"):
        llm.encode(PROMPTS, pooling_task="classify")
    with pytest.raises(ValueError, match=f"^classify: {name} classifies every token, not a whole prompt"):
        llm.classify(PROMPTS)
    with running_server(llm, ServerConfig()) as url:
        r = httpx.post(url + "/classify", json={"input": PROMPTS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "every token" in r.text, r.text


@pytest.mark.parametrize(
    "name, config",
    [("LlamaModel", LlamaConfig(**SIZES, num_key_value_heads=2)),
     ("Qwen2Model", Qwen2Config(**SIZES, num_key_value_heads=2)),
     ("GPTNeoXModel", GPTNeoXConfig(**SIZES)),  # (its causal LM's decoder is gpt_neox.*; GPT-2's transformer.*)
     ("GPT2Model", GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=64))],
)  # fmt: skip
def test_a_base_models_checkpoint_gives_hfs_last_hidden_states(name, config, tmp_path):
    """HF's base models (an embedding model's checkpoint: the decoder alone, stored without its prefix): every token's
    last hidden state and the taps as HF's, the embeddings read from them; generating refused by name."""
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    rows = llm.encode(PROMPTS, PoolingParams(normalize=False), pooling_task="token_embed", use_tqdm=False)
    for ids, out, traced in zip(PROMPTS, rows, llm.trace(PROMPTS, "blocks.0.hook_resid_post"), strict=True):
        with torch.inference_mode():
            want = hf(torch.tensor([ids]), output_hidden_states=True)
        assert rel_err(out.outputs.data, want.last_hidden_state[0]) < 1e-5
        assert rel_err(traced["blocks.0.hook_resid_post"], want.hidden_states[1][0]) < 1e-5
    [embedded] = llm.embed([PROMPTS[0]], pooling="last", use_tqdm=False)
    assert rel_err(embedded.outputs.embedding, rows[0].outputs.data[-1]) < 1e-6
    with pytest.raises(ValueError, match=f"^max_tokens: {name}: a base model's checkpoint has no LM head"):
        llm.generate(PROMPTS, use_tqdm=False)
    with pytest.raises(ValueError, match=f"^capture.logit_lens: {name}: a base model's"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=0, capture=Capture("blocks.0.hook_resid_post", logit_lens=2)))
    assert "unembed.hook_out" not in llm.hook_names()
    hooked = HookedLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match=f"^tokens: {name}: a base model's checkpoint has no LM head"):
        hooked.tokens_to_residual_directions(0)  # (what logit attributions read)


@pytest.mark.parametrize("mode, normalized", [("pooling_mode_lasttoken", True), ("pooling_mode_mean_tokens", False)])
def test_an_embedding_models_sentence_transformers_modules_set_its_defaults(mode, normalized, tmp_path):
    """An embedding model's checkpoint with sentence-transformers modules (e5-mistral's: the last token, normalised):
    LLM.embed, encode's "embed" and the server's /v1/embeddings read it so unless asked otherwise, as vLLM does."""
    torch.manual_seed(0)
    hf = transformers.LlamaModel(LlamaConfig(**SIZES, num_key_value_heads=2)).eval()
    hf.save_pretrained(tmp_path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalized:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, mode: True}))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    with torch.inference_mode():
        hidden = [hf(torch.tensor([ids])).last_hidden_state[0] for ids in PROMPTS]
    pooled = [h[-1] if mode == "pooling_mode_lasttoken" else h.mean(0) for h in hidden]
    want = [normalize(v, dim=0) if normalized else v for v in pooled]
    embedded = llm.embed(PROMPTS, use_tqdm=False)
    encoded = llm.encode(PROMPTS, pooling_task="embed", use_tqdm=False)
    for e, c, w, raw in zip(embedded, encoded, want, pooled, strict=True):
        assert rel_err(e.outputs.embedding, w) < 1e-5 and rel_err(c.outputs.data, w) < 1e-5
    assert rel_err(llm.embed(PROMPTS[:1], normalize=False, pooling="last", use_tqdm=False)[0].outputs.embedding,
                   hidden[0][-1]) < 1e-5  # (a request's own say first)
    with running_server(llm, ServerConfig()) as url:
        body = httpx.post(url + "/v1/embeddings", json={"input": PROMPTS}, timeout=60).json()
    assert all(rel_err(torch.tensor(d["embedding"]), w) < 1e-5 for d, w in zip(body["data"], want, strict=True))


def test_an_embedding_model_scores_pairs_by_the_cosine_of_their_embeddings(smol_path, tmp_path):
    """vLLM's bi-encoder scoring: LLM.score, /score and /rerank on a base model's checkpoint (over SmolLM2's
    tokenizer) give each pair the cosine of its two texts' last hidden states at their last tokens, as HF's."""
    from test_classify import DOCUMENTS, QUERY

    torch.manual_seed(0)
    hf = transformers.LlamaModel(LlamaConfig(**SIZES | dict(vocab_size=49152), num_key_value_heads=2)).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_path / name, tmp_path / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)

    def last(text: str) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0, -1]

    want = [torch.nn.functional.cosine_similarity(last(QUERY), last(d), dim=0).item() for d in DOCUMENTS]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert all(abs(o.outputs.score - w) < 1e-5 for o, w in zip(scores, want, strict=True))
    assert scores[0].prompt_token_ids == tokenizer(QUERY)["input_ids"] + tokenizer(DOCUMENTS[0])["input_ids"]
    with running_server(llm, ServerConfig()) as url:
        body = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
        ranked = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    assert all(abs(d["score"] - w) < 1e-5 for d, w in zip(body["data"], want, strict=True))
    assert [r["index"] for r in ranked["results"]] == sorted(range(len(want)), key=lambda i: -want[i])


@pytest.mark.parametrize(
    "call, message",
    [(lambda llm: llm.encode(TEXTS), "^pooling_task: None is not allowed; expected one of token_embed, "
                                     "token_classify, embed, classify$"),
     (lambda llm: llm.encode(TEXTS, pooling_task="encode"), "^pooling_task: 'encode' is not allowed"),
     (lambda llm: llm.reward(TEXTS), "^pooling_task: 'token_classify' needs a classifier's head .*LlamaForCausalLM "
                                     "is a causal LM"),
     (lambda llm: llm.encode(TEXTS, PoolingParams(use_activation=False), pooling_task="token_embed"),
      "^pooling_params.use_activation: 'token_embed' does not read it; it reads normalize, dimensions"),
     (lambda llm: llm.encode(TEXTS, {"normalize": False}, pooling_task="embed"),
      "^pooling_params: expected a PoolingParams, got dict"),
     (lambda llm: PoolingParams(normalize="no"), r"^pooling_params.normalize: 'no' is not allowed; expected a bool")],
)  # fmt: skip
def test_refusals_name_their_field_before_any_work(smol4, call, message):
    with pytest.raises(ValueError, match=message):
        call(smol4)
    assert not smol4.engine.has_work()


def test_a_classifier_refuses_normalize(reward_model):
    with pytest.raises(ValueError, match="^pooling_params.normalize: 'token_classify' does not read it"):
        reward_model[0].reward(PROMPTS, pooling_params=PoolingParams(normalize=True))


def test_the_servers_pooling_equals_llm_encode(smol, served_smol):
    """/pooling (vLLM's): each input's tensor as nested lists or base64 float32, equal to LLM.encode's; the chat
    form through the template; refusals as 400s naming the field."""
    offline = smol.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    with running_server(served_smol, ServerConfig(served_model_name="smol")) as url:
        body = httpx.post(url + "/pooling", json={"model": "smol", "input": TEXTS, "task": "token_embed"},
                          timeout=60).json()  # fmt: skip
        assert body["object"] == "list" and body["id"].startswith("pool-") and body["model"] == "smol"
        assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)
        for i, (d, o) in enumerate(zip(body["data"], offline, strict=True)):
            assert (d["index"], d["object"]) == (i, "pooling")
            assert rel_err(torch.tensor(d["data"]), o.outputs.data) < 1e-6
        packed = httpx.post(url + "/pooling", json={"input": TEXTS[0], "task": "embed", "normalize": False,
                                                    "encoding_format": "base64"}, timeout=60).json()  # fmt: skip
        [last] = smol.encode(TEXTS[0], PoolingParams(normalize=False), pooling_task="embed", use_tqdm=False)
        vector = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
        assert rel_err(torch.from_numpy(vector.copy()), last.outputs.data) < 1e-6
        chat = [{"role": "user", "content": TEXTS[0]}]
        ids = smol.tokenizer(smol.tokenizer.apply_chat_template(chat, tokenize=False),
                             add_special_tokens=False)["input_ids"]  # fmt: skip
        [d] = httpx.post(url + "/pooling", json={"messages": chat, "task": "token_embed"}, timeout=60).json()["data"]
        [want] = smol.encode([ids], pooling_task="token_embed", use_tqdm=False)
        assert rel_err(torch.tensor(d["data"]), want.outputs.data) < 1e-6
        # (/v1/embeddings' chat form, vLLM's: the conversation's embedding, as LLM.embed reads its rendered tokens)
        [e] = httpx.post(url + "/v1/embeddings", json={"messages": chat}, timeout=60).json()["data"]
        [want] = smol.embed([ids], use_tqdm=False)
        assert rel_err(torch.tensor(e["embedding"]), want.outputs.embedding) < 1e-6
        both = httpx.post(url + "/v1/embeddings", json={"messages": chat, "input": "x"}, timeout=60)
        assert both.status_code == 400 and both.json()["error"]["param"] == "input"
        for fields, status, param in [({"input": "x"}, 400, "task"), ({"input": "x", "task": "encode"}, 422, "task"),
                                      ({"input": "x", "task": "token_classify"}, 400, "task"),
                                      ({"input": "x", "task": "embed", "use_activation": True}, 400, "use_activation"),
                                      ({"task": "embed"}, 400, "input")]:  # fmt: skip
            r = httpx.post(url + "/pooling", json=fields, timeout=60)
            assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_the_servers_pooling_gives_a_reward_models_scores_at_every_token(tmp_path):
    config = LlamaConfig(**SIZES, num_key_value_heads=2, num_labels=1, id2label={0: "score"}, pad_token_id=0)
    hf = _saved(transformers.LlamaForSequenceClassification, config, tmp_path)
    served = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    with running_server(served, ServerConfig()) as url:
        body = httpx.post(url + "/pooling", json={"input": PROMPTS, "task": "token_classify", "use_activation": False},
                          timeout=60).json()  # fmt: skip
        for ids, d in zip(PROMPTS, body["data"], strict=True):
            assert rel_err(torch.tensor(d["data"]), _hf_token_logits(hf, ids)) < 1e-5
        r = httpx.post(url + "/pooling", json={"input": PROMPTS, "task": "classify", "normalize": True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "normalize", r.text
