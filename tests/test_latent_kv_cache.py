"""latent_kv_cache: multi-head latent attention (DeepSeek-V2/V3, Mistral 4, MiniCPM3) with the KV cache holding each
token's normed latent and rotated key part instead of every head's keys and values, the heads attending through
kv_b_proj's rows (vlens.models.deepseek). Against HF on the parity files' tiny checkpoints: every tap (the patterns,
and hook_k / hook_v expanded for their readers, among them) within 1e-5, packed against alone, greedy generation
through the paged cache; the cache's size a token; preemption under emulated decode graphs; one compiled graph of a
capturing step; edits of the latents, queries and head outputs as the expanded cache's engine makes them, edits of
the keys and values refused by name; two ranks as one process."""

from __future__ import annotations

import pytest
import torch
from family_parity import (
    COMMON,
    GenerationParity,
    TapParity,
    build,
    check_capturing_step_compiles,
    check_generation_under_pressure,
    family_fixture,
    same,
    sequences,
)
from test_parity_deepseek import CONFIGS as DEEPSEEK
from test_parity_latent_families import CONFIGS as LATENT_FAMILIES
from test_tensor_parallel import N, _check_outputs, _open, one_thread  # noqa: F401 - (autouse)
from transformers import LlamaConfig

from vlens import LLM, Capture, HookedLM, SamplingParams, Steer
from vlens.replacement import check_frozen_attention

CONFIGS = {name: DEEPSEEK[name] for name in ("deepseek_v3", "deepseek_v2")} | {
    name: LATENT_FAMILIES[name] for name in ("mistral4", "minicpm3")  # (Llama 4's temperature on q; µP's scales)
}
family = family_fixture(CONFIGS, latent_kv_cache=True)


class TestParity(TapParity, GenerationParity):
    generation_hooks = ("blocks.1.attn.hook_k", "blocks.2.attn.hook_v", "blocks.1.attn.hook_pattern",
                        "blocks.2.attn.hook_z")  # fmt: skip


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> str:
    return build(DEEPSEEK["deepseek_v3"](), tmp_path_factory.mktemp("v3"), "deepseek_v3")


def test_the_cache_holds_a_latent_a_token(v3):
    """kv_lora_rank 16 + 8 rotating dims a token and layer, for keys and for (padded) values, against 4 heads x 20
    dims: 10/3 as many tokens in the same bytes."""
    memory = 1 << 20
    latent = LLM(v3, dtype="float32", device="cpu", block_size=4, kv_cache_memory=memory, latent_kv_cache=True)
    expanded = LLM(v3, dtype="float32", device="cpu", block_size=4, kv_cache_memory=memory)
    shapes = {(a.num_kv_heads, a.head_dim, a.value_dim) for a in latent.model.attention_layers()}
    assert shapes == {(1, 24, 16)} and {a.head_dim for a in expanded.model.attention_layers()} == {20}
    assert latent.config.latent_kv_cache and not expanded.config.latent_kv_cache
    blocks = [llm.stats().kv_blocks_free for llm in (latent, expanded)]
    assert blocks == [memory // (3 * 2 * 4 * 24 * 4), memory // (3 * 2 * 4 * 4 * 20 * 4)]


def test_refused_for_a_model_without_latents(tmp_path):
    path = build(LlamaConfig(**COMMON), tmp_path, "llama")
    with pytest.raises(ValueError, match=r"latent_kv_cache: True caches the latents .*LlamaForCausalLM has none"):
        LLM(path, dtype="float32", device="cpu", latent_kv_cache=True)


def test_generation_under_pressure_through_replayed_graphs(tmp_path):
    """The latents of 192 tokens for three sequences of 90: preempted and recomputed, decode steps replayed."""
    path = build(DEEPSEEK["deepseek_v2_grouped"](), tmp_path, "pressure")
    check_generation_under_pressure(path, 192 * 3 * 2 * 24 * 4, "blocks.2.attn.hook_k", latent_kv_cache=True)


def test_a_capturing_step_compiles_whole(v3):
    """The absorbed projections in fixed shapes: one graph, a capture and a steer of hook_z."""
    check_capturing_step_compiles(v3, "blocks.1.attn.hook_z", latent_kv_cache=True)


def test_edits_as_the_expanded_cache_makes_them(v3):
    """Steers of the latent, the queries and one head's output, in one mixed batch with a plain request and a
    capture: the expanded cache's tokens and rows; an edit of the keys or values is refused before any work, and the
    engine serves on."""
    g = torch.Generator().manual_seed(0)
    steers = [Steer("blocks.1.attn.hook_kv_latent", torch.randn(16, generator=g), scale=4.0),
              Steer("blocks.0.attn.hook_q", torch.randn(4, 20, generator=g), scale=2.0),
              Steer("blocks.2.attn.hook_z", torch.randn(10, generator=g), scale=8.0, heads=[1])]  # fmt: skip
    hooks = ["blocks.2.attn.hook_z", "blocks.1.attn.hook_v", "blocks.2.hook_resid_post"]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks),
                             interventions=[s]) for s in steers]  # fmt: skip
    params += [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks)),
               SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]  # fmt: skip
    prompts = sequences((20, 9, 3, 14, 7))
    latent = LLM(v3, dtype="float32", device="cpu", block_size=4, latent_kv_cache=True)
    expanded = LLM(v3, dtype="float32", device="cpu", block_size=4)
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (latent, expanded))
    plain = expanded.generate(prompts[:3], params[-1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in want[:3]] != [o.outputs[0].token_ids for o in plain]  # (steers matter)
    for a, b in zip(got, want):
        for hook in a.activations:
            assert same(a.activations[hook], b.activations[hook], 1e-5), hook
    for hook in ("blocks.1.attn.hook_k", "blocks.2.attn.hook_v"):
        with pytest.raises(ValueError, match=rf"interventions\[0\]\.hook: '{hook}' cannot be edited with "
                                             "latent_kv_cache=True"):  # fmt: skip
            latent.generate(prompts[:1], SamplingParams(max_tokens=2, interventions=[Steer(hook, torch.ones(20))]),
                            use_tqdm=False)  # fmt: skip
    assert latent.generate([prompts[4]], params[-1], use_tqdm=False)[0].outputs[0].token_ids == \
        want[4].outputs[0].token_ids  # fmt: skip


def test_two_ranks_as_one_process(v3):
    """Each rank its heads' rows of kv_b_proj and the whole latent of every token in its cache."""
    one, two = _open(v3, latent_kv_cache=True), _open(v3, tensor_parallel_size=N, latent_kv_cache=True)
    try:
        hooks = ["blocks.0.attn.hook_z", "blocks.1.attn.hook_pattern", "blocks.2.hook_resid_post"]
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
        prompts = sequences((20, 9, 3))
        _check_outputs(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False))
    finally:
        two.close()


def test_hooks_that_edit_keys_and_frozen_attention_are_refused(v3):
    """TransformerLens's route: a hook editing hook_k fails by name (reading it gives HF's keys); what freezes the
    patterns through q and k (attribution graphs, feature interventions) refuses the model before it runs."""
    model = HookedLM(v3, dtype="float32", device="cpu", latent_kv_cache=True)
    expanded = HookedLM(v3, dtype="float32", device="cpu")
    tokens = torch.tensor([sequences()[-1]])
    _, cache = model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_k")
    _, want = expanded.run_with_cache(tokens, names_filter="blocks.1.attn.hook_k")
    assert same(cache["blocks.1.attn.hook_k"], want["blocks.1.attn.hook_k"], 1e-5)
    with pytest.raises(ValueError, match="blocks.0.attn.hook_k and blocks.0.attn.hook_v cannot be edited with "
                                         "latent_kv_cache=True"):  # fmt: skip
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_k", lambda value, hook: value * 2)])
    with pytest.raises(ValueError, match="an attribution graph: freezes attention patterns through attn.hook_q"):
        check_frozen_attention(model.cfg, "an attribution graph")


def test_the_triton_decode_kernel_reads_the_latent_cache(v3):
    """The paged kernel CUDA's decode graphs run (under Triton's interpreter here): one key-value head of the latent
    and the rotating part for all query heads, the values the latent padded: HF's tokens and rows."""
    from family_parity import check_generation, hf_auto_class
    from transformers import AutoConfig

    from vlens.attention.decode import DecodeBackend
    from vlens.attention.paged_decode import paged_decode

    llm = LLM(v3, dtype="float32", device="cpu", block_size=4, latent_kv_cache=True)
    llm.runner.decode_backend, llm.runner.pad_decode = DecodeBackend(paged_decode, programs=8), True
    hf = hf_auto_class(AutoConfig.from_pretrained(v3)).from_pretrained(v3, dtype=torch.float32).eval()
    check_generation(llm, hf, sequences((20, 9, 3)), extra_hooks=("blocks.1.attn.hook_z", "blocks.2.attn.hook_k"))
    assert llm.runner.graph_stats.static_eager_steps >= 7
