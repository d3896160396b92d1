"""GPTBigCode (SantaCoder, StarCoder 1 and StarCoderBase) against HF on tiny random checkpoints: GPT-2's model in
nn.Linear's layout with one key and value head for every query head (multi_query, as released), and without it (q, k
and v interleaved per head); every tap, packed against alone, greedy generation through the paged cache, bfloat16 bit
for bit."""

from __future__ import annotations

from family_parity import VOCAB, GenerationParity, TapParity, check_bfloat16_taps, family_fixture
from transformers import GPTBigCodeConfig

BIGCODE = dict(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128, n_inner=96, initializer_range=0.1)
CONFIGS = {
    "multi_query": lambda: GPTBigCodeConfig(**BIGCODE),
    "multi_head_untied_gelu": lambda: GPTBigCodeConfig(**BIGCODE, multi_query=False, tie_word_embeddings=False,
                                                       activation_function="gelu"),  # fmt: skip
}

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("hook_pos_embed",)


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "gpt_bigcode" and cfg.norm == "layer" and cfg.learned_positions and cfg.rotary_dim == 0
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1 if name == "multi_query" else 4, 16)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.intermediate_size) == (True, True, True, 96)
    assert cfg.hidden_act == ("gelu_pytorch_tanh" if name == "multi_query" else "gelu")
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings


def test_bfloat16_taps_are_hfs_bit_for_bit(tmp_path):
    check_bfloat16_taps(CONFIGS["multi_query"](), tmp_path)
