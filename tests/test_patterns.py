"""Attention scores and patterns per request through the engine, and per-head interventions.

The trace path of every family is checked tap by tap in the parity tests (hook_attn_scores and
hook_pattern included). Here: the rows of LLM.generate — prompt rows and generated rows, with prefill
chunked small so a row's keys sit in earlier chunks, in a mixed batch with requests capturing other
things — against HF's eager attention over the whole sequence; heads selection; head ablation and head
steering against HF with the same forward hook on o_proj's input; and bad inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, VOCAB, build
from hf_reference import hf_attention, hf_taps, same
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
)

from vlens import LLM, Ablate, Capture, Patch, SamplingParams, Steer

HEADS = COMMON["num_attention_heads"]
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "gemma2": lambda: Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                   query_pre_attn_scalar=16, attn_logit_softcapping=30.0),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                       query_pre_attn_scalar=16),
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=HEADS, n_positions=128),
    "gpt_neox": lambda: GPTNeoXConfig(**COMMON, rotary_pct=0.5),
    "phi3": lambda: Phi3Config(**COMMON, num_key_value_heads=2, pad_token_id=0),
    "mixtral": lambda: MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: Qwen2Config(**COMMON, num_key_value_heads=2),
    "gpt_oss": lambda: GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=6),  # (attention sinks)
    # ALiBi's per-head biases on every score
    "bloom": lambda: BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=HEADS, initializer_range=0.1),
    # unscaled scores of normalised q and k; the full layers' heads twice the size, keys their values
    "gemma4": lambda: Gemma4TextConfig(**COMMON, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                                       sliding_window=6, layer_types=["sliding_attention", "full_attention",
                                       "full_attention"], attention_k_eq_v=True, num_global_key_value_heads=1,
                                       hidden_size_per_layer_input=0),
}  # fmt: skip
# Layer 0 of the Gemma configs has a sliding window (6, shorter than the prompts), layer 1 full attention.
PATTERN = ["blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = build(FAMILIES[request.param](), tmp_path_factory.mktemp("patterns"), request.param)
    # 16-token steps: the 23- and 30-token prompts are prefilled in chunks, so rows need earlier chunks' keys
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
    return llm, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_generated_and_prompt_rows_equal_hf(family):
    llm, hf = family
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (23, 9, 30)]
    greedy = dict(max_tokens=5, temperature=0, ignore_eos=True)
    params = [
        SamplingParams(**greedy, capture=Capture(PATTERN, positions="all")),
        SamplingParams(**greedy, capture=Capture("blocks.0.hook_resid_post")),  # other captures in the batch
        SamplingParams(**greedy, capture=Capture("blocks.2.attn.hook_pattern", positions=[3, -1], heads=[1, 0])),
    ]
    full, other, picked = llm.generate(prompts, params, use_tqdm=False)
    for out in (full, picked):
        seq = out.prompt_token_ids + out.outputs[0].token_ids[:-1]  # every fed token: one row each
        ref = hf_taps(hf, seq, (0, 1, 2))
        rows = len(seq)
        if out is full:
            assert out.activation_positions.tolist() == list(range(rows))
            for name in PATTERN:
                assert out.activations[name].shape == (rows, HEADS, rows)  # K: the last row's context
                assert same(out.activations[name], ref[name], 1e-5), name
            pattern, scores = out.activations[PATTERN[1]], out.activations[PATTERN[0]]
            allowed = ~torch.isinf(scores)
            assert torch.equal(pattern[~allowed], torch.zeros(int((~allowed).sum())))
            sinks = getattr(hf.get_submodule(hf_attention(hf, 0)), "sinks", None)
            if sinks is None:  # a row's weights sum to one ...
                assert torch.allclose(pattern.sum(-1), torch.ones(rows, HEADS), atol=1e-5)
                assert rel_err(pattern, scores.softmax(-1)) <= 1e-6
            else:  # ... but for the share of gpt-oss's sink, one more logit that weighs no value
                logits = torch.cat([scores, sinks.detach().expand(rows, HEADS)[..., None]], dim=-1)
                assert (pattern.sum(-1) < 1).all()
                assert rel_err(pattern, logits.softmax(-1)[..., :-1]) <= 1e-6
            window = llm.config.sliding_windows[0]
            if window is not None:  # a row past the window sees only the last `window` keys
                p = rows - 1
                assert torch.isinf(scores[p, :, : p - window + 1]).all() and allowed[p, :, p - window + 1 :].all()
        else:
            assert out.activation_positions.tolist() == [3, rows - 1]
            want = ref["blocks.2.attn.hook_pattern"][[3, rows - 1]][:, [1, 0]]
            assert out.activations["blocks.2.attn.hook_pattern"].shape == (2, 2, rows)
            assert same(out.activations["blocks.2.attn.hook_pattern"], want, 1e-5)
    [alone] = llm.generate(prompts[1], params[1], use_tqdm=False)  # the batch did not touch the others
    assert rel_err(other.activations["blocks.0.hook_resid_post"], alone.activations["blocks.0.hook_resid_post"]) <= 1e-5


@pytest.fixture(scope="module")
def ablate_and_steer(smol, hf_smol):
    """Greedy tokens and layer-5 resid of three prompts in one batch: one ablates head 2 of layer 3's z,
    one mean-ablates head 1 and steers head 4 of layer 6, one does nothing."""
    d_head, heads = smol.config.head_dim, smol.config.num_heads
    g = torch.Generator().manual_seed(0)
    mean, vec = torch.randn(d_head, generator=g), torch.randn(d_head, generator=g) * 3
    prompts = ["The capital of France is", "Once upon a time there", "def fibonacci(n):"]
    capture = Capture("blocks.8.hook_resid_post")
    ivs = [
        [Ablate("blocks.3.attn.hook_z", heads=[2])],
        [Ablate("blocks.6.attn.hook_z", heads=[1], value=mean), Steer("blocks.6.attn.hook_z", vec, heads=[4])],
        [],
    ]
    outs = smol.generate(prompts, [SamplingParams(max_tokens=6, temperature=0, capture=capture, interventions=iv)
                                   for iv in ivs], use_tqdm=False)  # fmt: skip

    def edits_for(i):
        def edit(z):
            z = z.view(*z.shape[:-1], heads, d_head).clone()
            if i == 0:
                z[..., 2, :] = 0.0
            elif i == 1:
                z[..., 1, :] = mean
                z[..., 4, :] += vec
            return z.flatten(-2)

        layer = 3 if i == 0 else 6
        return hf_smol.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda m, a: (edit(a[0]),))

    refs = []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        handle = edits_for(i) if ivs[i] else None
        try:
            ids = smol.tokenizer(prompt, return_tensors="pt")["input_ids"]
            with torch.inference_mode():
                g_out = hf_smol.generate(ids, max_new_tokens=6, do_sample=False, output_hidden_states=True,
                                         return_dict_in_generate=True)  # fmt: skip
        finally:
            if handle is not None:
                handle.remove()
        refs.append((g_out.sequences[0, ids.shape[1] :].tolist(), torch.cat([s[9][0] for s in g_out.hidden_states])))
    return outs, refs


def test_head_ablation_and_steering_equal_hf(ablate_and_steer):
    outs, refs = ablate_and_steer
    for out, (tokens, resid) in zip(outs, refs):
        assert out.outputs[0].token_ids == tokens
        assert rel_err(out.activations["blocks.8.hook_resid_post"], resid) <= 1e-4


def test_head_patch_sets_only_those_heads(smol):
    d_head = smol.config.head_dim
    values = torch.randn(2, d_head, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(max_tokens=1, capture=Capture("blocks.4.attn.hook_z", positions="prompt"))
    [clean] = smol.generate("Hello there my friend", p, use_tqdm=False)
    patched_params = SamplingParams(max_tokens=1, capture=Capture("blocks.4.attn.hook_z", positions="prompt"),
                                    interventions=[Patch("blocks.4.attn.hook_z", values, heads=[5, 0])])  # fmt: skip
    [patched] = smol.generate("Hello there my friend", patched_params, use_tqdm=False)
    z, z0 = patched.activations["blocks.4.attn.hook_z"], clean.activations["blocks.4.attn.hook_z"]
    assert torch.equal(z[:, 5], values[0].expand_as(z[:, 5])) and torch.equal(z[:, 0], values[1].expand_as(z[:, 0]))
    others = [h for h in range(z.shape[1]) if h not in (0, 5)]
    assert torch.equal(z[:, others], z0[:, others])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SamplingParams(capture=Capture(PATTERN, heads=[9]), max_tokens=2), r"capture.heads: \[9\] out of range"),
        (lambda: Capture(PATTERN, heads=[1, 1]), "more than once"),
        (lambda: SamplingParams(capture=Capture("blocks.1.hook_resid_post", heads=[0]), max_tokens=2), "none of .* has heads"),
        (lambda: SamplingParams(capture=Capture(PATTERN, reduce="mean"), max_tokens=2), "capture.reduce"),
        (lambda: SamplingParams(interventions=[Ablate("blocks.1.attn.hook_z", heads=[12])], max_tokens=2), "out of range"),
        (lambda: SamplingParams(interventions=[Steer(PATTERN[1], [1.0] * 4)], max_tokens=2), "read-only"),
        (lambda: Ablate("blocks.1.attn.hook_z", [1.0] * 16, heads=[1]), "ablate.direction"),
    ],
)
def test_bad_inputs_name_the_fix(smol, make, message):
    with pytest.raises(ValueError, match=message):
        params = make()
        smol.generate([[1, 2, 3]], params, use_tqdm=False)
    assert not smol.engine.has_work()
    [ok] = smol.generate([[1, 2, 3]], SamplingParams(max_tokens=2, capture=Capture(PATTERN)), use_tqdm=False)
    assert ok.activations[PATTERN[1]].shape == (4, smol.config.num_heads, 4)  # and it keeps serving


def test_harvest_refuses_patterns(smol, tmp_path):
    from vlens import harvest

    source = tmp_path / "text.txt"
    source.write_text("hello world\n")
    with pytest.raises(ValueError, match="LLM.trace or LLM.generate"):
        harvest(smol, str(source), PATTERN[1], str(tmp_path / "out"))
