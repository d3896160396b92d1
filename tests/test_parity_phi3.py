"""Phi-3 against HF on tiny random checkpoints: fused qkv_proj and gate_up_proj loaded as they are,
partial rotary, LongRoPE (short factors, then long ones once a forward reaches past the original
context) and a sliding window; every tap, packed against alone, generation.

Generation that crosses the LongRoPE switch is compared step by step: there the engine recomputes the
sequence's cache with the long factors, which is what HF's per-step logits amount to."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, GenerationParity, TapParity, check_feature_matters, family_fixture
from transformers import Phi3Config

from vlens import LLM, Capture, SamplingParams

ROTARY_HALF = 4  # head_dim 16, partial_rotary_factor 0.5: 8 dims rotate, 4 frequencies
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [2.0, 5.0, 11.0, 20.0],
}
PHI3 = dict(COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "phi3_longrope": lambda: Phi3Config(**PHI3, original_max_position_embeddings=16, rope_parameters=LONGROPE),
    "phi3_window_gqa": lambda: Phi3Config(**PHI3, num_key_value_heads=2, sliding_window=7),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """The traced lengths 1 and 23, 40 sit either side of the LongRoPE switch (16). In generation the
    20-token prompt runs on the long factors throughout, the others on the short ones."""

    generation_lengths = (20, 7, 3)


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    assert cfg.family == "llama" and cfg.stored_fused
    if name == "phi3_longrope":
        assert cfg.rotary_dim == 2 * ROTARY_HALF and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == 16 and cfg.rope_scaling["factor"] == 8.0
    else:
        assert cfg.sliding_windows == (7, 7, 7) and cfg.num_kv_heads == 2


longrope = family_fixture({"phi3_longrope": CONFIGS["phi3_longrope"]}, name="longrope")  # for the switch


def test_long_factors_matter(tmp_path):
    short_only = LONGROPE | {"long_factor": LONGROPE["short_factor"]}
    check_feature_matters(CONFIGS["phi3_longrope"](), tmp_path, rope_parameters=short_only)


@pytest.mark.parametrize("budget", [4096, 4])
def test_generation_across_the_longrope_switch(longrope, budget):
    """A 10-token prompt crosses the switch (16) at the 7th generated token; every step's logits equal
    HF's, also when the recompute runs in 4-token chunks."""
    _, path, _, hf = longrope
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=budget)
    prompt = list(range(3, 13))
    with torch.inference_mode():
        g = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            eos_token_id=None,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, capture=Capture(hooks="unembed.hook_out"))
    [out] = llm.generate([prompt], p, use_tqdm=False)
    assert out.outputs[0].token_ids == g.sequences[0, len(prompt) :].tolist()
    per_step = out.activations["unembed.hook_out"][len(prompt) - 1 :]
    for i, ref in enumerate(g.logits):
        assert rel_err(per_step[i], ref[0]) < 1e-5, i
