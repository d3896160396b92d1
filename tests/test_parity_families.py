"""Parity with Hugging Face across the Llama family's variants, on tiny random checkpoints read from disk.

Each config turns on something the SmolLM2 test cannot reach: rope scaling (llama3, linear), sliding
windows shorter than the test sequences (Mistral everywhere, Qwen2 on layers >= max_window_layers),
q/k/v biases (Qwen2), q/k norm (Qwen3), tied and untied embeddings, GQA and MQA, head_dim unlike
hidden/heads. HF initialises norms to one and biases to zero, which would let a model that ignores
them pass; the checkpoints are re-saved with those weights randomised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import rel_err, save_tiny
from hf_reference import hf_taps, layer_hooks, rows_shape, same
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from vlens import LLM

TOL = 1e-5
VOCAB = 300
SEQ_LENS = (1, 23, 40)  # the longer ones outrun every window and the llama3 original context below

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.1,  # larger than HF's 0.02 so attention is far from uniform
)

CONFIGS = {
    # rope_parameters spelled the transformers-5 way
    "llama_llama3_gqa": lambda: LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # rope_scaling, the transformers-4 spelling the config class still accepts
    "llama_linear_tied_mha": lambda: LlamaConfig(
        **COMMON, num_key_value_heads=4, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 4.0}
    ),
    "llama_mqa_head_dim_biases": lambda: LlamaConfig(
        **COMMON, num_key_value_heads=1, head_dim=24, attention_bias=True, mlp_bias=True
    ),
    "mistral_window": lambda: MistralConfig(**COMMON, num_key_value_heads=2, head_dim=8, sliding_window=7),
    "qwen2_tied": lambda: Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2_window_layers": lambda: Qwen2Config(
        **COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "qwen3_head_dim": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32),
    "qwen3_tied_mqa_bias": lambda: Qwen3Config(
        **COMMON, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True, attention_bias=True
    ),
}


def randomise_norms_and_biases(path: Path, seed: int = 1) -> None:
    """Rewrite the checkpoint with norm weights around one and biases around zero, not exactly that."""
    file = path / "model.safetensors"
    weights = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for key, w in weights.items():
        if key.endswith("norm.weight"):
            weights[key] = 1 + 0.3 * torch.randn(w.shape, generator=g)
        elif key.endswith(".bias"):
            weights[key] = 0.2 * torch.randn(w.shape, generator=g)
    save_file(weights, file, metadata={"format": "pt"})


def build(name: str, root: Path) -> str:
    path = root / name
    save_tiny(CONFIGS[name](), path)
    randomise_norms_and_biases(path)
    return str(path)


@pytest.fixture(scope="module")
def sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in SEQ_LENS]


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    path = build(request.param, tmp_path_factory.mktemp("families"))
    llm = LLM(model=path, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, llm, hf


def all_hooks(n_layers: int) -> list[str]:
    return layer_hooks(range(n_layers)) + [f"hidden_states.{i}" for i in range(n_layers + 1)] + [
        "ln_final.hook_scale",
        "ln_final.hook_normalized",
        "ln_final.hook_out",
        "unembed.hook_out",
    ]


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert llm.tokenizer is None  # weights-only checkpoint: token ids in
    assert cfg.num_kv_heads == hf.config.num_key_value_heads and cfg.num_heads == 4
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (llm.model.lm_head.weight is llm.model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    expected = {
        "llama_llama3_gqa": dict(rope=("llama3", 8.0), windows=(None,) * 3),
        "llama_linear_tied_mha": dict(rope=("linear", 4.0), windows=(None,) * 3),
        "llama_mqa_head_dim_biases": dict(head_dim=24, qkv_bias=True, o_bias=True, mlp_bias=True),
        "mistral_window": dict(head_dim=8, windows=(7, 7, 7)),
        "qwen2_tied": dict(qkv_bias=True, o_bias=False, windows=(None,) * 3),
        "qwen2_window_layers": dict(qkv_bias=True, windows=(None, 5, 5)),
        "qwen3_head_dim": dict(head_dim=32, qk_norm=True, qkv_bias=False),
        "qwen3_tied_mqa_bias": dict(head_dim=8, qk_norm=True, qkv_bias=True, o_bias=True),
    }[name]
    for key, value in expected.items():
        if key == "rope":
            assert (cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == value
        elif key == "windows":
            assert cfg.sliding_windows == value
        else:
            assert getattr(cfg, key) == value, key
    if "head_dim" in expected:
        assert cfg.head_dim != cfg.hidden_size // cfg.num_heads


def test_every_tap_matches_hf(family, sequences):
    name, _, llm, hf = family
    n = llm.config.num_layers
    hooks = all_hooks(n)
    shapes = llm.hook_names()
    outs = llm.trace(sequences, hooks=hooks)  # packed, all lengths in one call
    failures = []
    for ids, got in zip(sequences, outs):
        ref = hf_taps(hf, ids, range(n))
        for hook in hooks:
            assert tuple(got[hook].shape) == rows_shape(shapes[hook], len(ids)) == tuple(ref[hook].shape), hook
            if not same(got[hook], ref[hook], TOL):
                failures.append(f"{name} len {len(ids)} {hook}: rel_err {rel_err(got[hook], ref[hook]):.3g}")
    assert not failures, failures


def test_packed_equals_alone(family, sequences):
    _, _, llm, _ = family
    hooks = all_hooks(llm.config.num_layers)
    packed = llm.trace(sequences, hooks=hooks)
    for ids, together in zip(sequences, packed):
        alone = llm.trace([ids], hooks=hooks)[0]
        for hook in hooks:
            assert same(together[hook], alone[hook], TOL), (len(ids), hook)


# What turning a feature off in HF does to the logits; if the test sequences did not reach the feature,
# the parity above would prove nothing about it.
FEATURE_OFF = {
    "llama_llama3_gqa": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "llama_linear_tied_mha": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "mistral_window": {"sliding_window": None},
    "qwen2_window_layers": {"layer_types": ["full_attention"] * 3},
}


@pytest.mark.parametrize("name", list(FEATURE_OFF))
def test_the_feature_matters_for_these_sequences(name, sequences, tmp_path):
    path = build(name, tmp_path)
    llm = LLM(model=path, dtype="float32", device="cpu")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **FEATURE_OFF[name]).eval()
    longest = sequences[-1]
    got = llm.trace([longest], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    with torch.no_grad():
        without = plain(torch.tensor([longest])).logits[0]
    assert rel_err(got, without) > 1e-3
    # Windows and scaled frequencies change nothing while a sequence is short enough.
    if "window" in name:
        first = slice(0, 5)
        assert rel_err(got[first], without[first]) <= TOL


def test_transformers4_config_spelling(tmp_path, sequences):
    """Most hub checkpoints were saved by transformers 4: top-level rope_theta, rope_scaling with "type"."""
    path = Path(build("llama_linear_tied_mha", tmp_path))
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters")
    config |= {"rope_theta": 2500.0, "rope_scaling": {"type": "linear", "factor": 3.0}}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    assert llm.config.rope_theta == 2500.0 and llm.config.rope_scaling["factor"] == 3.0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hooks = ["blocks.*.attn.hook_{q,k}", "unembed.hook_out"]
    for ids, got in zip(sequences, llm.trace(sequences, hooks=hooks)):
        ref = hf_taps(hf, ids, range(3))
        for hook, value in got.items():
            assert rel_err(value, ref[hook]) <= TOL, hook


def test_config_without_architectures_falls_back_on_model_type(tmp_path, sequences):
    path = Path(build("qwen3_head_dim", tmp_path))
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    assert llm.config.architecture == "Qwen3ForCausalLM" and llm.config.qk_norm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = llm.trace([sequences[1]], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    assert rel_err(got, hf_taps(hf, sequences[1], [])["unembed.hook_out"]) <= TOL
