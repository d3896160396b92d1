"""Mamba, Falcon Mamba and Mamba 2 (models with no attention and no MLP: a norm and a Mamba mixer a layer) against HF
on tiny random checkpoints: every tap (Mamba's selective scan: x after a biased causal convolution, B, C, the time
step from its low-rank projection, a state per channel and state dimension, D's skip, the gate; Falcon Mamba's
weightless norms of B, C and the time step's input; Mamba 2's heads and groups), packed against alone on sequences
past one 64-row chunk, greedy generation through the state slots (chunked prefill, preemption, emulated decode graphs,
inductor-compiled decode steps); bfloat16 bit for bit, its float32 residual stream included; HF's own meaning of
hidden_states.{i} (Mamba's: each layer's output); TransformerLens-style calls; tensor parallelism of Mamba 2."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from family_parity import (
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_capturing_step_compiles,
    check_compiled_decode,
    check_every_tap,
    check_generation_under_pressure,
    family_fixture,
    same,
    sequences,
)
from transformers import FalconMambaConfig, Mamba2Config, MambaConfig

from vlens import LLM, HookedLM, SamplingParams, Steer

SIZES = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, initializer_range=0.1, state_size=8, expand=2)


def mamba_config(**overrides) -> MambaConfig:
    return MambaConfig(**(SIZES | dict(conv_kernel=4, time_step_rank=8) | overrides))


def mamba2_config(**overrides) -> Mamba2Config:
    return Mamba2Config(**(SIZES | dict(num_heads=4, head_dim=32, n_groups=2, chunk_size=64) | overrides))


CONFIGS = {
    "mamba": mamba_config,
    # (biased projections, no convolution bias, an untied unembedding, a wider low rank)
    "mamba_biased": lambda: mamba_config(use_bias=True, use_conv_bias=False, tie_word_embeddings=False,
                                         time_step_rank=16),  # fmt: skip
    "falcon_mamba": lambda: FalconMambaConfig(**(SIZES | dict(conv_kernel=4, time_step_rank=8, mixer_rms_eps=1e-3))),
    "mamba2": mamba2_config,
}

family = family_fixture(CONFIGS)
MIXER = [f"blocks.1.mamba.hook_{kind}" for kind in ("x", "b", "c", "dt", "ssm_out", "gate", "z")]


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.mamba.hook_ssm_out", "blocks.2.mamba.hook_z")

    def required_hooks(self, llm):
        return MIXER + ["blocks.1.hook_attn_out", "blocks.1.hook_resid_post"]


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "mamba" and cfg.layer_parts == ("mixer",) * 3 and cfg.num_heads == 0 and cfg.residual_float32
    assert cfg.ssm_layers == (True,) * 3 and not any(map(cfg.attends, range(3)))
    if name == "mamba2":
        assert (cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_groups, cfg.ssm_dt_rank) == (4, 32, 2, 0)
    else:
        assert (cfg.ssm_inner, cfg.ssm_state_size) == (128, 8) and cfg.hidden_states_after_layers
        assert cfg.ssm_dt_rank == (16 if name == "mamba_biased" else 8)
        assert cfg.ssm_bcdt_norm_eps == (1e-3 if name == "falcon_mamba" else None)
    # (no keys or values to cache: the blocks only hold the sequences' state slots)
    assert llm.runner.kv_cache == [] and llm.engine.blocks.num_states > 0
    assert not any(h.startswith(("ln2.", "mlp.")) or "resid_mid" in h for h in llm.hook_names())


def test_chunks_match_hf(family):
    _, _, llm, hf = family
    check_every_tap(llm, hf, sequences((1, 64, 65, 130)))


def test_hidden_states_mean_what_they_mean_in_hf(family):
    """HF's MambaForCausalLM and FalconMamba give each layer's output as hidden_states[i] (no embedding), Mamba 2 the
    stream entering layer i: the alias follows each (and check_every_tap holds them to HF's values)."""
    name, _, llm, _ = family
    got = llm.trace([sequences()[-1]], hooks=["hidden_states.*", "blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"])
    kind = "hook_resid_pre" if name == "mamba2" else "hook_resid_post"
    for i in range(3):
        assert torch.equal(got[0][f"hidden_states.{i}"], got[0][f"blocks.{i}.{kind}"])


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_generation_through_chunked_prefill_few_slots_and_graphs(tmp_path, name):
    """Prompts fed 32 tokens a step (each continuing its convolutions' inputs and SSM states), room for the states of
    two sequences of the three (no keys to cache: the whole kv_cache_memory holds states), decode steps replayed from
    emulated CUDA graphs: HF generate's tokens and hidden states."""
    path = build(CONFIGS[name](), tmp_path, name)
    llm = check_generation_under_pressure(path, 3 * llm_state_bytes(path), "blocks.0.mamba.hook_z", preempts=False)
    assert llm.engine.blocks.num_states == 2


def llm_state_bytes(path: str) -> int:
    """One sequence's state slot in every layer, in bytes (the runner's count)."""
    from vlens.engine.model_runner import ModelRunner

    return ModelRunner.bytes_per_state(LLM(model=path, dtype="float32", device="cpu").model)


@pytest.mark.parametrize("name", ["mamba", "falcon_mamba", "mamba2"])
def test_bfloat16_taps(tmp_path, name):
    """Every tap bit for bit HF's, which keeps the stream between layers in float32 (residual_in_fp32)."""
    check_bfloat16_taps(CONFIGS[name](), tmp_path)


def test_compiled_decode_steps_equal_eager_ones(tmp_path):
    """compile_decode: the decode steps, the SSM states read and written through index buffers, compiled (inductor)
    with the capture of a Mamba layer's taps: the eager engine's tokens and rows."""
    hooks = ["blocks.0.mamba.hook_ssm_out", "blocks.2.mamba.hook_dt"]
    check_compiled_decode(build(mamba_config(), tmp_path, "mamba"), hooks)


def test_steering_a_mamba_layer_leaves_the_others_in_its_batch(family):
    """A steer of one request's mixer channels, beside a request that asks for nothing: the plain one's tokens are
    those it gets alone, the steered one's differ."""
    _, _, llm, _ = family
    hook, width = "blocks.1.mamba.hook_z", llm.hook_names()["blocks.1.mamba.hook_z"][-1]
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    steered = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                             interventions=[Steer(hook, torch.full((width,), 4.0))])  # fmt: skip
    prompts = sequences((20, 9))
    alone = llm.generate(prompts[:1], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [plain, steered], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].token_ids != llm.generate(prompts[1:], plain, use_tqdm=False)[0].outputs[0].token_ids


def test_transformer_lens_style_calls(tmp_path):
    """HookedLM on Mamba: run_with_cache equals the engine's trace, each layer's mixer output sums the stream
    (decompose_resid), Mamba 2's heads sum its mixer output (stack_head_results), and what a Mamba has none of (heads,
    MLPs) is refused by name."""
    toks = torch.tensor([sequences()[-1]])
    for name in ("mamba", "mamba2"):
        model = HookedLM(build(CONFIGS[name](), tmp_path, name), dtype="float32", device="cpu")
        _, cache = model.run_with_cache(toks)
        stack = cache.decompose_resid()
        assert same(stack.sum(0), cache["blocks.2.hook_resid_post"], 1e-6)
        heads = cache.stack_head_results(layer=2)
        assert heads.shape[0] == (8 if name == "mamba2" else 0)
        if name == "mamba2":
            assert same(heads.sum(0), cache["blocks.0.hook_attn_out"] + cache["blocks.1.hook_attn_out"], 1e-5)
        for call, message in ((lambda: model.W_Q, "has no attention"), (lambda: model.blocks[0].attn, "Mamba"),
                              (lambda: model.blocks[0].mlp, "no MLP"), (lambda: cache.decompose_resid(mode="mlp"),
                                                                         "no MLP")):  # fmt: skip
            with pytest.raises(ValueError, match=message):
                call()


def test_a_split_the_channels_cannot_take_is_refused(tmp_path):
    """Mamba's mixer splits by channels (tests/test_tensor_parallel.py): 3 ranks for its 128 are refused, naming the
    sizes that divide them, before any worker starts."""
    path = build(mamba_config(), tmp_path, "mamba")
    before = set(multiprocessing.active_children())
    refusal = r"tensor_parallel_size: 3 does not divide the Mamba mixers' channels \(intermediate_size\)=128; allowed"
    with pytest.raises(ValueError, match=refusal + r" for this model: \[1, 2, 4, 8, 16,"):
        LLM(model=path, dtype="float32", device="cpu", tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_a_capturing_step_compiles_whole(tmp_path, name):
    """torch.compile(fullgraph=True) of a mixed step (two sequences decode while two prefill: the chunks' layout
    planned by the runner, the states read and written through index buffers), one request capturing a Mamba layer's
    taps and one steering its scan's output: no graph break, one compile, the eager step's stream and rows."""
    config = (mamba_config if name == "mamba" else mamba2_config)(num_hidden_layers=1)  # (its compile unrolls steps)
    check_capturing_step_compiles(build(config, tmp_path, name), "blocks.0.mamba.hook_ssm_out")
