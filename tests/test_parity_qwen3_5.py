"""Qwen 3.5 (dense and MoE) and Qwen3-Next against HF on tiny random checkpoints: gated delta nets (linear attention
over a recurrent state, after a causal convolution; grouped value heads) on most layers, gated full attention with a
quarter-rotary head on the others, (1 + w) norms, experts beside a gated shared expert, Qwen3-Next's projections
grouped by key head; every tap, packed against alone (sequences longer than one 64-row chunk), greedy generation
through the paged cache and the state slots, chunked prefill, the static decode step, preemption; the text model of
the multimodal checkpoints; capture and steering in a batch; HookedLM's TransformerLens calls and patching."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_bfloat16_taps,
    check_compiled_decode,
    check_every_tap,
    check_generation,
    family_fixture,
    load_pair,
    sequences,
)
from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

from vlens import LLM, Capture, SamplingParams

LINEAR = dict(linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
TEXT = dict(COMMON, num_key_value_heads=2, head_dim=16)


def text_config(**overrides) -> Qwen3_5TextConfig:
    layers = ["linear_attention", "full_attention", "linear_attention"]
    return Qwen3_5TextConfig(**(TEXT | LINEAR | dict(linear_num_value_heads=4, layer_types=layers) | overrides))


def moe_config() -> Qwen3_5MoeTextConfig:
    """Qwen 3.5's MoE layout: experts on every layer (top 2 of 4, renormalised) beside a gated shared expert."""
    layers = ["linear_attention", "linear_attention", "full_attention"]
    sizes = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return Qwen3_5MoeTextConfig(**(TEXT | LINEAR | sizes | dict(linear_num_value_heads=4, layer_types=layers)))


def next_config(**overrides) -> Qwen3NextConfig:
    """Qwen3-Next: Qwen 3.5's layers, the checkpoint's linear projections grouped by key head (two value heads each),
    experts (not renormalised) beside a shared expert on every layer but a dense one."""
    sizes = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 mlp_only_layers=[1], norm_topk_prob=False)  # fmt: skip
    layers = ["linear_attention", "full_attention", "linear_attention"]
    return Qwen3NextConfig(**(TEXT | LINEAR | sizes | dict(linear_num_value_heads=4, layer_types=layers) | overrides))


CONFIGS = {
    "qwen3_5": text_config,
    "qwen3_5_moe": moe_config,
    "qwen3_next": next_config,
    # (value heads as many as key heads; full attention first, tied)
    "qwen3_5_mha_tied": lambda: text_config(linear_num_value_heads=2, num_key_value_heads=4, tie_word_embeddings=True,
                                            layer_types=["full_attention", "linear_attention", "linear_attention"]),
}
LONG = (1, 23, 64, 65, 127)  # (a chunk, one more, nearly two)

family = family_fixture(CONFIGS)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.*.linear_attn.hook_core_out", "blocks.*.attn.hook_gate")

    def required_hooks(self, llm):
        cfg = llm.config
        linear = [i for i in range(3) if cfg.is_linear_layer(i)]
        full = [i for i in range(3) if not cfg.is_linear_layer(i)]
        kinds = ("q", "k", "v", "beta", "decay", "core_out", "gate", "z")
        hooks = [f"blocks.{linear[0]}.linear_attn.hook_{k}" for k in kinds] + [f"blocks.{full[0]}.attn.hook_gate"]
        moe = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_ids",
               "mlp.shared_expert.hook_post")  # fmt: skip
        return hooks + [f"blocks.{layer}.{kind}" for layer in range(3) for kind in moe if cfg.is_moe_layer(layer)]


def test_config_is_read_as_intended(family):
    name, _, llm, hf = family
    cfg = llm.config
    assert cfg.family == "qwen3_5" and cfg.norm == "rms_offset" and cfg.qk_norm == "head" and cfg.attn_output_gate
    moe = name in ("qwen3_5_moe", "qwen3_next")
    layers = {"qwen3_5_moe": (True,) * 3, "qwen3_next": (True, False, True)}.get(name, ())
    assert cfg.moe_layers == layers and cfg.norm_topk_prob == (name != "qwen3_next")
    assert cfg.linear_stored_grouped == (name == "qwen3_next")
    assert (cfg.num_experts, cfg.experts_per_token, cfg.shared_expert_intermediate_size) == ((4, 2, 48) if moe else
                                                                                            (0, 0, 0))  # fmt: skip
    assert cfg.rotary_dim == 4  # (a quarter of each 16-wide head)
    assert (cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv_kernel) == (2, 8, 8, 4)
    assert cfg.linear_layers == tuple(kind == "linear_attention" for kind in hf.config.layer_types)
    assert (llm.model.lm_head.weight is llm.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    assert llm.engine.blocks.enable_prefix_caching  # (the engine, and its cache, made here if not before)
    assert len(llm.runner.kv_cache) == 1  # (the one attention layer's; the others keep states)


def test_chunks_match_hf(family):
    """Sequences of one chunk, one past it and nearly two: every tap, packed against alone (HF runs each alone)."""
    _, _, llm, hf = family
    check_every_tap(llm, hf, sequences(LONG))


def test_generation_through_chunked_prefill_and_static_decode(tmp_path):
    """Prompts fed 16 tokens a step (each chunk continuing its states; decodes beside them in the same steps, by the
    recurrence), decodes on the static path, prompts of more than a chunk: HF generate's tokens and hidden states."""
    path = build(text_config(), tmp_path, "qwen3_5")
    _, hf = load_pair(path)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
    llm.runner.pad_decode = True  # (three sequences in a bucket of four: a padding row on the scratch state slot)
    check_generation(llm, hf, sequences((70, 9, 33, 1)), max_tokens=10, extra_hooks=("blocks.2.linear_attn.hook_z",))
    assert llm.runner.graph_stats.static_eager_steps > 0


def test_state_slots_are_reused_and_preemption_recomputes(tmp_path):
    """More prompts than sequences at once, and a cache so small that sequences are preempted: every output is
    the one it has alone, and every state slot is free at the end."""
    path = build(text_config(), tmp_path, "qwen3_5")
    prompts = sequences((12, 30, 5, 17, 25, 8))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    expected = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    # (14 blocks of 4 tokens for the one attention layer's keys and values, 1 KiB each, after 3 state slots of the
    # two linear layers, 3.5 KiB each)
    tight = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_seqs=2,
                kv_cache_memory=3 * 3584 + 14 * 1024)  # fmt: skip
    got = [out.outputs[0].token_ids for out in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    blocks = tight.engine.blocks
    assert tight.engine.scheduler.num_preemptions > 0
    assert sorted(blocks.free_states) == [0, 1] and not blocks.state_of


@pytest.mark.parametrize("multimodal, text", [(Qwen3_5Config, text_config), (Qwen3_5MoeConfig, moe_config)])
def test_multimodal_text_model(tmp_path, multimodal, text):
    """Qwen3_5ForConditionalGeneration's (and the MoE's) text model, under model.language_model., against HF's model
    given text."""
    config = multimodal(text_config=text().to_dict(), vision_config=dict(depth=1, hidden_size=32, intermediate_size=32,
                                                                         num_heads=2, out_hidden_size=64))  # fmt: skip
    path = build(config, tmp_path, "qwen3_5_vl")
    llm, hf = load_pair(path)
    assert llm.config.architecture == multimodal.__name__.replace("Config", "ForCausalLM")
    assert llm.config.stored_as[0] == "model.language_model."
    check_every_tap(llm, hf, sequences())


def test_bfloat16_taps(tmp_path):
    check_bfloat16_taps(text_config(), tmp_path)


def test_capture_and_steer_in_a_mixed_batch(tmp_path):
    """A request that captures a linear layer's taps and one that steers it, beside a plain one: each gets its own
    rows and tokens, as alone; the steered logits are those of a forward with the same edit as a hook."""
    from vlens import HookedLM, Steer

    path = build(text_config(), tmp_path, "qwen3_5")
    hooked = HookedLM(path, dtype="float32", device="cpu", block_size=4)
    llm, hook = hooked.llm, "blocks.0.linear_attn.hook_z"
    prompts = sequences((9, 14, 6))
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    capture = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=hook))
    steer = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks="unembed.hook_out"),
                           interventions=[Steer(hook, torch.full((4, 8), 0.5))])  # fmt: skip
    mixed = llm.generate(prompts, [plain, capture, steer], use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p, params in zip(prompts, [plain, capture, steer])]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    rows = mixed[1].activations[hook]
    assert rows.shape == (14 + 6 - 1, 4, 8) and rel_err(rows, alone[1].activations[hook]) <= 1e-5
    steered = prompts[2] + mixed[2].outputs[0].token_ids[:-1]
    assert rel_err(rows[:14], llm.trace([prompts[1]], hooks=hook)[0][hook]) <= 1e-5
    with hooked.hooks(fwd_hooks=[(hook, lambda x, hook: x + 0.5)]):
        want = hooked(torch.tensor([steered]))[0]
    assert rel_err(mixed[2].activations["unembed.hook_out"], want) <= 1e-5
    assert rel_err(want, hooked(torch.tensor([steered]))[0]) > 1e-3


def test_a_split_of_fewer_key_heads_than_ranks_is_refused(tmp_path):
    """A linear layer splits by key heads (tests/test_tensor_parallel.py): with one key head, two ranks are refused
    before any weight loads."""
    path = build(text_config(linear_num_key_heads=1, linear_num_value_heads=2), tmp_path, "qwen3_5")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide linear_num_key_heads=1; allowed"):
        LLM(model=path, dtype="float32", device="cpu", tensor_parallel_size=2)


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    from vlens import HookedLM

    return HookedLM(build(text_config(), tmp_path_factory.mktemp("hooked"), "qwen3_5"), dtype="float32", device="cpu",
                    block_size=4)  # fmt: skip


def test_transformer_lens_calls(hooked):
    """Per-head results of a linear layer (its value heads through out_proj's columns) sum to its hook_attn_out; a
    gated attention layer's W_Q is its query rows alone; what a linear layer lacks is refused by name."""
    tokens = torch.tensor([sequences((12,))[0]])
    _, cache = hooked.run_with_cache(tokens)
    heads, labels = cache.stack_head_results(layer=1, return_labels=True)
    assert labels == [f"L0H{h}" for h in range(4)]
    assert rel_err(heads.sum(0), cache["blocks.0.hook_attn_out"]) <= 1e-5
    q_proj = hooked.llm.model.layers[1].self_attn.qkv_proj.weight[: 4 * 32].view(4, 2, 16, 64)[:, 0]
    assert torch.equal(hooked.blocks[1].attn.W_Q, q_proj.transpose(1, 2))
    decomposed = cache.get_full_resid_decomposition(layer=-1, expand_neurons=False)
    assert rel_err(decomposed.sum(0), cache["blocks.2.hook_resid_post"]) <= 1e-5
    with pytest.raises(ValueError, match="layer 0 is linear attention"):
        hooked.blocks[0].attn.W_Q
    with pytest.raises(ValueError, match=r"W_Q: .* read model.blocks\[L\].attn.W_Q of those layers"):
        hooked.W_Q


def test_generate_with_hooks_runs_its_own_state_slots(hooked):
    """HookedLM.generate with a hook function (its steps over lent blocks and state slots) gives what generate
    without one gives, where the hook changes nothing, and other tokens where it does; the slots come back."""
    tokens = torch.tensor(sequences((7, 7)))
    plain = hooked.generate(tokens, max_new_tokens=5, do_sample=False, verbose=False)
    seen = []
    with hooked.hooks(fwd_hooks=[("blocks.0.linear_attn.hook_z", lambda x, hook: seen.append(len(x)))]):
        same = hooked.generate(tokens, max_new_tokens=5, do_sample=False, verbose=False)
    assert torch.equal(same, plain) and len(seen) == 5
    with hooked.hooks(fwd_hooks=[("blocks.0.linear_attn.hook_z", lambda x, hook: x * 4)]):
        edited = hooked.generate(tokens, max_new_tokens=5, do_sample=False, verbose=False)
    assert not torch.equal(edited, plain)
    blocks = hooked.llm.engine.blocks
    assert len(blocks.free_states) == blocks.num_states and not blocks.state_of


@pytest.mark.parametrize("slots", [None, 3], ids=["slots_enough", "one_copy_a_forward"])
def test_patching_equals_transformer_lens_looping_over_vlens(hooked, tmp_path, slots):
    """Copies of a text run from position 0 (a linear layer's state at a copy's first changed position is not
    kept): vlens's patching module gives what TransformerLens's, one run_with_hooks per patch, gives; with 3 state
    slots, 2 held by the corrupted run, the copies run one a forward."""
    from transformer_lens import patching as theirs

    from vlens import HookedLM
    from vlens import patching as ours

    if slots is not None:
        path = build(text_config(), tmp_path, "qwen3_5")
        hooked = HookedLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=slots)

    clean = torch.tensor(sequences((9, 9)))
    corrupted = clean.clone()
    corrupted[:, 4] = (clean[:, 4] + 1) % 300
    _, cache = hooked.run_with_cache(clean)
    metric = lambda logits: logits[:, -1].log_softmax(-1)[:, 7].mean()  # noqa: E731
    for name in ("get_act_patch_resid_pre", "get_act_patch_attn_out"):
        got = getattr(ours, name)(hooked, corrupted, cache, metric)
        want = getattr(theirs, name)(hooked, corrupted, cache, metric)
        assert (got - want).abs().max() <= 1e-5 and want.abs().max() > 1e-3, name


def test_compiled_decode_steps_equal_eager_ones(tmp_path):
    """compile_decode: the decode steps, states read and written through index buffers, compiled (inductor) with
    the capture of a linear layer's taps: the eager engine's tokens and rows."""
    hooks = ["blocks.0.linear_attn.hook_z", "blocks.2.linear_attn.hook_decay"]
    check_compiled_decode(build(text_config(), tmp_path, "qwen3_5"), hooks)


@pytest.mark.parametrize("config", [moe_config, next_config])
def test_moe_bfloat16_taps(tmp_path, config):
    check_bfloat16_taps(config(), tmp_path)


def test_attribution_graphs_are_refused(hooked):
    """An attribution graph freezes attention patterns, which a linear-attention layer has none of: refused by name
    before any forward."""
    from vlens.attribution_graph import attribute

    with pytest.raises(ValueError, match=r"an attribution graph: freezes attention patterns, .* layers \[0, 2\]"):
        attribute(hooked, sequences((5,))[0], transcoders=[])


def test_decode_graphs_replay_from_the_states_their_capture_found(tmp_path):
    """A decode step's graph is captured by running the step once, then replayed: the states that run advanced go
    back first, so the graphs' tokens and rows are the eager engine's (CUDA graphs' semantics on the CPU:
    tests/replayed_graphs.py)."""
    from replayed_graphs import replay_graphs

    path = build(text_config(), tmp_path, "qwen3_5")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                            capture=Capture(hooks=["blocks.0.linear_attn.hook_z", "unembed.hook_out"]))  # fmt: skip
    prompts = sequences((9, 14, 3))
    graphed = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    replay_graphs(graphed.runner)
    eager = LLM(model=path, dtype="float32", device="cpu", block_size=4, enforce_eager=True)
    outs = graphed.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False)
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for hook, rows in a.activations.items():
            assert rel_err(rows, b.activations[hook]) <= 1e-5, hook
    stats = graphed.runner.graph_stats
    assert stats.graphs_captured > 0 and stats.graph_steps > 0


def test_fewer_state_slots_than_sequences_run_fewer_at_once(tmp_path):
    """States take at most half the cache's memory: with room for 3 slots (and the scratch one) of 8 sequences, the
    engine runs 3 at once, each as alone; a budget without room for one sequence's states is refused by name."""
    path = build(text_config(), tmp_path, "qwen3_5")
    prompts = sequences((12, 30, 5, 17, 25, 8))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    expected = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    per_state = 3584  # (two linear layers: a convolution's 3 inputs of 64 channels and a 4 x 8 x 8 state, float32)
    # (32 KiB: half of it holds 4 slots, 3 and the scratch one; the rest holds 18 blocks of 1 KiB)
    tight = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8, kv_cache_memory=32 * 1024)
    assert tight.engine.blocks.num_states == 3
    assert [out.outputs[0].token_ids for out in tight.generate(prompts, params, use_tqdm=False)] == expected
    small = LLM(model=path, dtype="float32", device="cpu", kv_cache_memory=3 * per_state)
    with pytest.raises(ValueError, match="kv_cache_memory: .* half of which must hold the states of two sequences"):
        small.generate(prompts, params, use_tqdm=False)  # (the engine is made for the first request)
