"""MPT (MosaicML's MPT-7B and MPT-30B) against HF on tiny random checkpoints: GPT-2's layer under MPT's names with
ALiBi (MPT's slopes: four heads, and six, where two come from the next power of two), LayerNorms without biases, no
biases anywhere, q/k/v clipped or not; every tap (the attention scores relative to each query, as HF's at a decode
step: HF's prefill measures them from its last key, a constant apart in each row), packed against alone, greedy
generation through the paged cache; attention options HF's MPT does not apply refused by name."""

from __future__ import annotations

import pytest
import torch
from family_parity import VOCAB, GenerationParity, TapParity, build, family_fixture
from transformers import MptConfig

from vlens import LLM
from vlens.config import UnsupportedModelError
from vlens.layers.attention import Alibi

MPT = dict(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=3, max_seq_len=128, initializer_range=0.1,
           use_cache=True)  # (HF generate: one step a token, as the reference reads it)
CONFIGS = {
    "mpt": lambda: MptConfig(**MPT),
    "mpt_six_heads_clipped": lambda: MptConfig(**MPT | dict(d_model=96, n_heads=6), tie_word_embeddings=False,
                                               attn_config={"clip_qkv": 0.4, "softmax_scale": 0.2}),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    """Every tap against HF, packed against alone, greedy generation through the paged cache."""


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "mpt" and cfg.alibi == "mpt" and cfg.norm == "layer_nobias" and cfg.rotary_dim == 0
    six = name == "mpt_six_heads_clipped"
    assert (cfg.num_heads, cfg.head_dim, cfg.intermediate_size) == ((6, 16, 384) if six else (4, 16, 256))
    assert (cfg.clip_qkv, cfg.attn_scale) == ((0.4, 0.2) if six else (None, None))
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias) and cfg.hidden_act == "gelu"
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings


@pytest.mark.parametrize("heads", [4, 6, 12])
def test_slopes_are_hfs(heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ref = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0]
    assert torch.equal(Alibi(heads, "mpt").slopes(range(heads), torch.device("cpu")), ref)


@pytest.mark.parametrize(("attn_config", "named"), [({"qk_ln": True}, "qk_ln=True"),
                                                    ({"attn_type": "multiquery_attention"}, "attn_type=")])
def test_options_hf_ignores_are_refused_by_name(tmp_path, attn_config, named):
    path = build(MptConfig(**MPT), tmp_path, "mpt")
    config = MptConfig.from_pretrained(path)
    for key, value in attn_config.items():
        setattr(config.attn_config, key, value)
    config.save_pretrained(path)
    with pytest.raises(UnsupportedModelError, match=f"{named}.*MptForCausalLM"):
        LLM(model=path, dtype="float32", device="cpu")
