"""GPT-NeoX / Pythia against HF on tiny random checkpoints: parallel and sequential residual, partial
rotary, the per-head interleaved fused q/k/v; every tap, packed against alone, generation. Under the
parallel residual the model has no hook_resid_mid (HF has no such tensor either)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    build,
    check_every_tap,
    check_generation,
    check_packed_equals_alone,
    load_pair,
    sequences,
)
from transformers import AutoConfig, AutoModelForCausalLM, GPTNeoXConfig

CONFIGS = {
    "pythia_parallel": lambda: GPTNeoXConfig(**COMMON),  # rotary_pct 0.25: 4 of 16 dims rotate
    "neox_sequential_half_rotary_tied": lambda: GPTNeoXConfig(
        **COMMON, use_parallel_residual=False, rotary_pct=0.5, attention_bias=False, tie_word_embeddings=True
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    path = build(CONFIGS[request.param](), tmp_path_factory.mktemp("neox"), request.param)
    return request.param, path, *load_pair(path)


def test_config_is_read_as_intended(family):
    name, _, llm, _ = family
    cfg = llm.config
    parallel = name == "pythia_parallel"
    assert cfg.family == "gpt_neox" and cfg.norm == "layer" and cfg.parallel_residual == parallel
    assert cfg.rotary_dim == (4 if parallel else 8) and cfg.head_dim == 16
    assert ("blocks.0.hook_resid_mid" in llm.hook_names()) != parallel


def test_every_tap_matches_hf(family):
    _, _, llm, hf = family
    check_every_tap(llm, hf, sequences())


def test_packed_equals_alone(family):
    check_packed_equals_alone(family[2], sequences())


def test_generation_matches_hf(family):
    _, _, llm, hf = family
    check_generation(llm, hf, sequences((20, 9, 3)))


def test_the_rotary_fraction_matters(tmp_path):
    path = build(CONFIGS["pythia_parallel"](), tmp_path, "pythia")
    llm, _ = load_pair(path)
    config = AutoConfig.from_pretrained(path)
    config.rope_parameters["partial_rotary_factor"] = 1.0
    full = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    ids = sequences()[-1]
    got = llm.trace([ids], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    with torch.no_grad():
        assert rel_err(got, full(torch.tensor([ids])).logits[0]) > 1e-3
