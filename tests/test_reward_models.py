"""Qwen's outcome and process reward models (Qwen2.5-Math-RM's Qwen2ForRewardModel, Qwen2.5-Math-PRM's
Qwen2ForProcessRewardModel: remote code, which vLLM runs): the Qwen2 decoder under a two-layer head (Linear, ReLU,
Linear), a score at every token; LLM.reward equal to the head the model's code defines over HF's Qwen2 decoder, and
vLLM's step pooling (`step_tag_id`: the rows of the step tags alone; `returned_token_ids`: the classes kept, before the
softmax), also on a causal LM read as its tokens' logits (Math-Shepherd's "+" and "-")."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import rel_err
from safetensors.torch import save_file
from transformers import Qwen2Config

from vlens import LLM, HookedLM, PoolingParams

SIZES = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
STEP = 7  # the step tag's token (Qwen2.5-Math-PRM's is <extra_0>)
PROMPTS = [[5, 17, 33, STEP, 9, 101, 4, STEP], [44, STEP], [7, 7, 190, 3]]


def _reward_model(path, architecture: str, classes: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random checkpoint laid out as Qwen's reward models are (the decoder under model.*, the head under score.0 and
    score.2); HF's Qwen2 decoder and the head, as the model's own code runs them."""
    torch.manual_seed(0)
    config = Qwen2Config(**SIZES)
    decoder = transformers.Qwen2Model(config).eval()
    head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes)).eval()
    tensors = {f"model.{k}": v for k, v in decoder.state_dict().items()} | \
        {f"score.{k}": v for k, v in head.state_dict().items()}  # fmt: skip
    path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config.to_dict() | {"architectures": [architecture]}))
    return decoder, head


def _hf_scores(decoder, head, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return head(decoder(torch.tensor([ids])).last_hidden_state)[0]


@pytest.fixture(scope="module")
def prm(tmp_path_factory):
    path = tmp_path_factory.mktemp("prm")
    decoder, head = _reward_model(path, "Qwen2ForProcessRewardModel", 2)
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20), decoder, head


def test_a_process_reward_models_steps_are_its_softmax_at_the_step_tags(prm):
    """LLM.reward: the softmax of the head's two classes at every token (vLLM's token_classify), or with step_tag_id
    at the step tags alone, the rows Qwen2.5-Math-PRM's card reads (P(right) is the second column); returned_token_ids
    keeps classes before the softmax, as vLLM's step pooling."""
    llm, decoder, head = prm
    assert llm.config.classifier_labels == ("LABEL_0", "LABEL_1") and llm.config.classifier_per_token
    every = llm.reward(PROMPTS, use_tqdm=False)
    steps = llm.reward(PROMPTS, pooling_params=PoolingParams(step_tag_id=STEP), use_tqdm=False)
    kept = llm.reward(PROMPTS, pooling_params=PoolingParams(step_tag_id=STEP, returned_token_ids=[1]), use_tqdm=False)
    raw = llm.reward(PROMPTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    for ids, e, s, k, r in zip(PROMPTS, every, steps, kept, raw, strict=True):
        logits = _hf_scores(decoder, head, ids)
        at = torch.tensor(ids) == STEP
        assert e.outputs.data.shape == (len(ids), 2) and rel_err(e.outputs.data, logits.softmax(-1)) < 1e-5
        assert rel_err(r.outputs.data, logits) < 1e-5
        assert s.outputs.data.shape == (int(at.sum()), 2) and rel_err(s.outputs.data, logits.softmax(-1)[at]) < 1e-5
        assert torch.equal(k.outputs.data, torch.ones(int(at.sum()), 1))  # (one class kept: the softmax of one)
    with pytest.raises(ValueError, match="^pooling_task: 'classify' reads a whole prompt"):
        llm.encode(PROMPTS, pooling_task="classify")


def test_a_two_layer_heads_logits_are_not_attributed(prm):
    """Direct logit attribution needs a linear head: a reward model's ReLU between its layers is refused by name."""
    llm, _, _ = prm
    model = HookedLM(str(llm.model_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    _, cache = model.run_with_cache(torch.tensor([PROMPTS[0]]), return_type=None)
    with pytest.raises(ValueError, match="^tokens: Qwen2ForProcessRewardModel's head is two layers with a ReLU"):
        cache.logit_attrs(cache.decompose_resid(), 1)


def test_an_outcome_reward_models_score_at_every_token(tmp_path):
    """Qwen2ForRewardModel: one class whatever the config's num_labels (vLLM's), its score at every token, through
    the sigmoid of one class unless use_activation=False."""
    decoder, head = _reward_model(tmp_path, "Qwen2ForRewardModel", 1)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    assert len(llm.config.classifier_labels) == 1
    raw = llm.reward(PROMPTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    probs = llm.reward(PROMPTS, use_tqdm=False)
    for ids, r, p in zip(PROMPTS, raw, probs, strict=True):
        want = _hf_scores(decoder, head, ids)
        assert rel_err(r.outputs.data, want) < 1e-5 and rel_err(p.outputs.data, want.sigmoid()) < 1e-5


def test_step_pooling_of_a_causal_lm_read_as_its_tokens(tmp_path):
    """Math-Shepherd's recipe on vlens: a causal LM whose "+" and "-" logits at each step tag judge the step
    (hf_overrides' no_post_processing head of the two tokens), its softmax over the two at the tags alone."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).eval()
    hf.save_pretrained(tmp_path)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(SIZES["vocab_size"]))
    tokenizer.save_pretrained(tmp_path)
    overrides = {"architectures": ["LlamaForTokenClassification"], "method": "no_post_processing",
                 "classifier_from_token": ["+", "-"]}  # fmt: skip
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, hf_overrides=overrides)
    plus, minus = tokenizer.convert_tokens_to_ids(["+", "-"])
    [out] = llm.reward([PROMPTS[0]], pooling_params=PoolingParams(step_tag_id=STEP), use_tqdm=False)
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPTS[0]])).logits[0][:, [plus, minus]]
    assert rel_err(out.outputs.data, logits.softmax(-1)[torch.tensor(PROMPTS[0]) == STEP]) < 1e-5


def _word_tokenizer(size: int):
    """A word-level tokenizer of `size` tokens, "+" and "-" among them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"+": 0, "-": 1} | {f"w{i}": i for i in range(2, size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_step_pooling_refused_by_name(prm):
    llm, _, _ = prm
    cases = [
        (PoolingParams(returned_token_ids=[2]), "token_classify",
         "pooling_params.returned_token_ids: 2 is not allowed; the head's classes are 0 to 1"),
        (PoolingParams(step_tag_id=STEP), "embed", "pooling_params.step_tag_id: 'embed' does not read it"),
    ]
    for params, task, message in cases:
        with pytest.raises(ValueError) as e:
            llm.encode(PROMPTS, params, pooling_task=task)
        assert message in str(e.value)
    bad_fields = [(dict(step_tag_id=-1), "pooling_params.step_tag_id: -1 is not allowed"),
                  (dict(returned_token_ids=[]), "pooling_params.returned_token_ids: [] is not allowed"),
                  (dict(returned_token_ids="1"), "pooling_params.returned_token_ids: '1' is not allowed")]  # fmt: skip
    for bad, message in bad_fields:
        with pytest.raises(ValueError) as e:
            PoolingParams(**bad)
        assert message in str(e.value)
