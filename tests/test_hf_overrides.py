"""vLLM's hf_overrides and what its users set with them: a causal LM read as a reranker or classifier made of its
tokens' unembedding rows (classifier_from_token: Qwen3-Reranker's yes/no as vLLM reads it, equal to HF's two-way
softmax at the last token; bge-reranker-v2-gemma's raw token logits), and a matryoshka embedding model's vectors cut
to their first dims (PoolingParams.dimensions, /v1/embeddings' and /pooling's `dimensions`), equal to HF's last
hidden state cut, then normalised; every refusal naming its field before any work."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from conftest import rel_err
from server_helpers import running_server
from transformers import Qwen3Config

from vlens import LLM, HookedLM, PoolingParams
from vlens.engine.config import EngineConfig
from vlens.server.config import ServerConfig

QUERIES = ["<Instruct>: Is this relevant?\n<Query>: What is the capital of China?\n<Document>: ",
           "<Query>: gravity\n<Document>: "]  # fmt: skip
DOCUMENTS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other."]
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}  # fmt: skip (vLLM's recipe for Qwen/Qwen3-Reranker-*)
normalize = torch.nn.functional.normalize
EXAMPLES = Path(__file__).parent.parent / "examples"


def _causal_lm(path, tokenizer_from, tied: bool) -> torch.nn.Module:
    """A random Qwen3 causal LM of the default model's vocabulary (its tokenizer copied), saved as a checkpoint."""
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         tie_word_embeddings=tied)  # fmt: skip
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # (logits of a larger scale than HF's initialisation: probabilities away from 1/2)
        hf.lm_head.weight.normal_(0, 0.1)
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return hf


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def causal_lm(request, smol4_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_causal")
    return path, _causal_lm(path, smol4_path, request.param)


def _hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def test_qwen3_reranker_scores_are_hfs_two_way_softmax(causal_lm, smol4_path):
    """Qwen3-Reranker's recipe: a pair's score is P(yes) of the softmax over the last token's "no" and "yes" logits
    (the model card's), as LLM.score and the server's /score and /rerank give it, each pair one text (vLLM's); the head
    is the unembedding's yes row less its no row (the lm_head's, or the embedding's where they are tied)."""
    path, hf = causal_lm
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, hf_overrides=RERANKER)
    assert llm.config.classifier_labels == ("yes",) and llm.config.classifier_activation == "sigmoid"
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    scores = llm.score(QUERIES, DOCUMENTS, use_tqdm=False)
    for query, document, out in zip(QUERIES, DOCUMENTS, scores, strict=True):
        # (vLLM's LLM as a reranker reads the two as one text, not the tokenizer's pair: " The" is one token here)
        ids = tokenizer(query + document)["input_ids"]
        assert ids != tokenizer(query, document)["input_ids"] and out.prompt_token_ids == ids
        logits = _hf_last_logits(hf, ids)
        want = logits[[no, yes]].softmax(-1)[1].item()
        assert abs(out.outputs.score - want) < 1e-5 and 0.01 < want < 0.99
    with running_server(llm, ServerConfig()) as url:
        body = httpx.post(f"{url}/rerank", json={"query": QUERIES[0], "documents": DOCUMENTS}, timeout=60).json()
    served = {r["index"]: r["relevance_score"] for r in body["results"]}
    first = llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)
    assert all(abs(served[i] - out.outputs.score) < 1e-6 for i, out in enumerate(first))


def test_tokens_without_post_processing_are_hfs_token_logits(causal_lm):
    """vLLM's no_post_processing (bge-reranker-v2-gemma's "Yes"): one class per token, its logit the token's logit
    at the last row, through a sigmoid for one token and a softmax for several; per token too (LLM.reward)."""
    path, hf = causal_lm
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "method": "no_post_processing"}
    one = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20,
              hf_overrides=overrides | {"classifier_from_token": ["yes"]})  # fmt: skip
    three = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20,
                hf_overrides=overrides | {"classifier_from_token": ["no", "maybe", "yes"]})  # fmt: skip
    ids = one.get_tokenizer().convert_tokens_to_ids(["no", "maybe", "yes"])
    assert three.config.classifier_labels == ("no", "maybe", "yes")
    ones, threes = one.classify(DOCUMENTS, use_tqdm=False), three.classify(DOCUMENTS, use_tqdm=False)
    for text, a, b in zip(DOCUMENTS, ones, threes, strict=True):
        logits = _hf_last_logits(hf, one.get_tokenizer()(text)["input_ids"])[ids]
        assert rel_err(torch.tensor(a.outputs.logits), logits[2:]) < 1e-5
        assert abs(a.outputs.probs[0] - logits[2].sigmoid().item()) < 1e-6
        assert rel_err(torch.tensor(b.outputs.probs), logits.softmax(-1)) < 1e-5 and b.outputs.label == \
            ("no", "maybe", "yes")[int(logits.argmax())]  # fmt: skip
    ids_of = one.get_tokenizer()(DOCUMENTS[1])["input_ids"]
    (reward,) = one.reward([ids_of], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    with torch.inference_mode():
        every = hf(torch.tensor([ids_of])).logits[0, :, ids[2]].float()
    assert reward.outputs.data.shape == (len(ids_of), 1) and rel_err(reward.outputs.data[:, 0], every) < 1e-5
    with pytest.raises(ValueError, match="^pooling_params.dimensions: 'classify' does not read it; it reads "
                                         "use_activation"):  # fmt: skip
        one.classify(DOCUMENTS, pooling_params=PoolingParams(dimensions=8))


def test_a_rerankers_yes_is_the_sum_of_its_components_shares(causal_lm):
    """Direct logit attribution on a classifier: `cache.logit_attrs` of the class "yes" is each component's share of
    its logit, here yes less no at the last token, and summed over the residual stream's pieces it is HF's logit
    difference; a class that is not one is refused by name."""
    path, hf = causal_lm
    model = HookedLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, hf_overrides=RERANKER)
    ids = model.tokenizer(QUERIES[0] + DOCUMENTS[0])["input_ids"]
    _, cache = model.run_with_cache(torch.tensor([ids]), return_type=None)
    stack, labels = cache.decompose_resid(return_labels=True)
    shares = cache.logit_attrs(stack, "yes")[:, 0, -1]
    assert shares.shape == (len(labels),) and torch.equal(shares, cache.logit_attrs(stack, 0)[:, 0, -1])
    logits = _hf_last_logits(hf, ids)
    no, yes = model.tokenizer.convert_tokens_to_ids(["no", "yes"])
    assert abs(shares.sum().item() - (logits[yes] - logits[no]).item()) < 1e-4
    with pytest.raises(ValueError, match="^tokens: 'no' is no class of this classifier; its classes: yes"):
        cache.logit_attrs(stack, "no")
    with pytest.raises(ValueError, match=r"^tokens: class indices must be in 0\.\.0 \(this model's classes\)"):
        cache.logit_attrs(stack, 1)


def test_the_reranker_attribution_example(causal_lm):
    """examples/reranker_attribution.py on a random Qwen3 read as a reranker: its ranking is LLM.score's, and the
    best document's direct shares sum to the logit whose sigmoid is its score."""
    spec = importlib.util.spec_from_file_location("reranker_attribution", EXAMPLES / "reranker_attribution.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    path, _ = causal_lm
    model = HookedLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, hf_overrides=RERANKER)
    found = example.rank_and_attribute(model, example.QUERY, example.DOCUMENTS, top=3)
    scores = [p[1] for p in found["ranked"]]
    assert sorted(p[0] for p in found["ranked"]) == sorted(example.DOCUMENTS) and scores == sorted(scores)[::-1]
    assert abs(torch.sigmoid(torch.tensor(found["yes_less_no"])).item() - scores[0]) < 1e-5
    assert len(found["parts"]) == len(found["heads"]) == 3
    assert all(label.startswith("L") and "H" in label for label, _ in found["heads"])


def test_two_ranks_read_the_head_from_the_whole_unembedding(causal_lm):
    """Under tensor parallelism each rank holds a slice of the vocabulary; the head's rows come from the checkpoint,
    so two ranks score as one process (and every rank reads the overrides)."""
    path, _ = causal_lm
    one = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, hf_overrides=RERANKER)
    with LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, hf_overrides=RERANKER,
             tensor_parallel_size=2) as two:  # fmt: skip
        for a, b in zip(one.score(QUERIES, DOCUMENTS, use_tqdm=False), two.score(QUERIES, DOCUMENTS, use_tqdm=False)):
            assert abs(a.outputs.score - b.outputs.score) < 1e-6


def test_classifier_tokens_refused_by_name(causal_lm):
    path, _ = causal_lm
    cases = [
        ({"method": "from_3_way"}, "method: 'from_3_way' is not allowed; expected one of from_2_way_softmax"),
        ({"classifier_from_token": ["yes"]},
         "classifier_from_token: ['yes'] is not allowed; from_2_way_softmax reads two"),
        ({"classifier_from_token": ["no", "zzzqqq"]}, "classifier_from_token: 'zzzqqq' is no token"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError) as e:
            LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, hf_overrides=RERANKER | overrides)
        assert message in str(e.value)


@pytest.fixture(scope="module")
def matryoshka(smol4_path) -> LLM:
    return LLM(str(smol4_path), dtype="float32", device="cpu", kv_cache_memory=16 << 20,
               hf_overrides={"is_matryoshka": True})  # fmt: skip


def test_matryoshka_dimensions_cut_before_normalising(matryoshka, smol4_path):
    """PoolingParams.dimensions keeps an embedding's first dims, then normalises (vLLM's order): LLM.embed, encode's
    "embed" and "token_embed", and the server's /v1/embeddings and /pooling, each HF's last hidden state cut."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(smol4_path, dtype=torch.float32).eval()
    texts = ["The capital of France is", "Hi"]
    cut = PoolingParams(dimensions=64, normalize=True)  # (LLM.embed's default: not normalised, as the hook has it)
    embedded = matryoshka.embed(texts, pooling="last", pooling_params=cut, use_tqdm=False)
    last = matryoshka.encode(texts, cut, pooling_task="embed", use_tqdm=False)
    raw = matryoshka.encode(texts, PoolingParams(dimensions=32, normalize=False), pooling_task="token_embed",
                            use_tqdm=False)  # fmt: skip
    for e, out, r in zip(embedded, last, raw, strict=True):
        with torch.inference_mode():
            hidden = hf(torch.tensor([out.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0]
        want = normalize(hidden[-1, :64], dim=0)
        assert e.outputs.embedding.shape == (64,) and rel_err(e.outputs.embedding, want) < 1e-5
        assert rel_err(out.outputs.data, want) < 1e-5
        assert r.outputs.data.shape == (len(out.prompt_token_ids), 32)
        assert rel_err(r.outputs.data, hidden[:, :32]) < 1e-5
    with running_server(matryoshka, ServerConfig(embedding_pooling="last")) as url:
        served = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "dimensions": 64, "normalize": True},
                            timeout=60).json()  # fmt: skip
        pooled = httpx.post(f"{url}/pooling", json={"input": texts, "task": "embed", "dimensions": 64},
                            timeout=60).json()  # fmt: skip
        refused = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "dimensions": 0}, timeout=60)
    for e, s, p in zip(embedded, served["data"], pooled["data"], strict=True):
        assert rel_err(torch.tensor(s["embedding"]), e.outputs.embedding) < 1e-6
        assert rel_err(torch.tensor(p["data"]), e.outputs.embedding) < 1e-6
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


def test_dimensions_refused_by_name(matryoshka, smol4, smol4_path):
    """vLLM's rules: only a matryoshka model is cut, to a width it names where it names some; and vlens's: a width
    within the embedding's, the embedding's own rows, an embedding task's field."""
    cases = [
        (smol4, "embed", 64, "pooling_params.dimensions: the model was not trained for shorter embeddings"),
        (matryoshka, "embed", 0, "pooling_params.dimensions: 0 is not allowed; expected an integer >= 1"),
        (matryoshka, "embed", 577, "pooling_params.dimensions: 577 is not allowed; expected a width from 1 to the "
                                   "embedding's 576"),
    ]
    for llm, task, dims, message in cases:
        with pytest.raises(ValueError) as e:
            llm.encode(["Hi"], PoolingParams(dimensions=dims), pooling_task=task)
        assert message in str(e.value)
    with pytest.raises(ValueError, match="pooling_params.dimensions: cuts the model's embedding"):
        matryoshka.embed(["Hi"], hook="blocks.1.hook_resid_post", pooling_params=PoolingParams(dimensions=8))
    listed = LLM(str(smol4_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20,
                 hf_overrides={"matryoshka_dimensions": [64, 128]})  # fmt: skip
    assert listed.config.matryoshka and listed.encode(["Hi"], PoolingParams(dimensions=128), pooling_task="embed",
                                                      use_tqdm=False)[0].outputs.data.shape == (128,)  # fmt: skip
    with pytest.raises(ValueError, match="pooling_params.dimensions: 100 is not allowed; the model was trained for "
                                         "widths 64, 128"):  # fmt: skip
        listed.embed(["Hi"], pooling_params=PoolingParams(dimensions=100))


def test_hf_overrides_setting():
    """A JSON object from the command line (`--hf-overrides '{...}'`), a dict from Python; anything else refused."""
    assert EngineConfig(hf_overrides='{"is_matryoshka": true}').hf_overrides == {"is_matryoshka": True}
    assert EngineConfig(hf_overrides={"text_config": {"x": 1}}).hf_overrides == {"text_config": {"x": 1}}
    for bad, message in [("{is_matryoshka}", "hf_overrides: '{is_matryoshka}' is not JSON"),
                         ("[1]", "hf_overrides: expected a dict of names (a JSON object), got [1]"),
                         (3, "hf_overrides: expected a dict of names")]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            EngineConfig(hf_overrides=bad)
        assert message in str(e.value)
