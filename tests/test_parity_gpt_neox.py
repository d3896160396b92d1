"""GPT-NeoX / Pythia against HF on tiny random checkpoints: parallel and sequential residual, partial
rotary, the per-head interleaved fused q/k/v; every tap, packed against alone, generation. Under the
parallel residual the model has no hook_resid_mid (HF has no such tensor either)."""

from __future__ import annotations

from family_parity import COMMON, GenerationParity, TapParity, check_feature_matters, family_fixture
from transformers import GPTNeoXConfig

CONFIGS = {
    "pythia_parallel": lambda: GPTNeoXConfig(**COMMON),  # rotary_pct 0.25: 4 of 16 dims rotate
    "neox_sequential_half_rotary_tied": lambda: GPTNeoXConfig(
        **COMMON, use_parallel_residual=False, rotary_pct=0.5, attention_bias=False, tie_word_embeddings=True
    ),
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap, packed against alone, generation (family_parity)."""


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    parallel = name == "pythia_parallel"
    assert cfg.family == "gpt_neox" and cfg.norm == "layer" and cfg.parallel_residual == parallel
    assert cfg.rotary_dim == (4 if parallel else 8) and cfg.head_dim == 16
    assert ("blocks.0.hook_resid_mid" in llm.hook_names()) != parallel


def test_the_rotary_fraction_matters(tmp_path):
    config = CONFIGS["pythia_parallel"]()
    check_feature_matters(config, tmp_path, rope_parameters=config.rope_parameters | {"partial_rotary_factor": 1.0})
