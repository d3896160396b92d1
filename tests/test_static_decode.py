"""The static decode step — what a CUDA graph captures and replays on a GPU — run eagerly on the CPU against
the ordinary step: decode batches padded to a power-of-two bucket (padding rows on the scratch block),
block tables padded to a page bucket, taps armed at power-of-two sizes, vlens.attention.decode's kernel.
Greedy tokens must be equal and every captured row and steered output within 1e-5 (float32), with plain,
capturing (hooks, logits, attention pattern, SAE features), steered, ablated, per-head steered and
clamped requests in one batch, on a GQA Llama and on Gemma 2 (soft-capping, sliding windows)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from transformers import Gemma2Config, LlamaConfig

from vlens import LLM, SAE, Ablate, Capture, Clamp, SamplingParams, Steer

D = COMMON["hidden_size"]
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "gemma2": lambda: Gemma2Config(
        **COMMON, num_key_value_heads=2, head_dim=24, sliding_window=7, query_pre_attn_scalar=20,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def llm(request, tmp_path_factory) -> LLM:
    path = build(FAMILIES[request.param](), tmp_path_factory.mktemp("static"), request.param)
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8)


def _requests(seed: int, head_dim: int) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    sae = SAE(
        W_enc=torch.randn(D, 32, generator=g), b_enc=torch.randn(32, generator=g), W_dec=torch.randn(32, D, generator=g),
        b_dec=torch.randn(D, generator=g), architecture="standard", hook="blocks.1.hook_resid_post",
    )  # fmt: skip
    common = dict(max_tokens=12, temperature=0, ignore_eos=True)
    params = [
        SamplingParams(**common),
        SamplingParams(**common, capture=Capture(["blocks.1.hook_resid_post", "blocks.0.attn.hook_z", "unembed.hook_out"],
                                                  positions="generated")),  # fmt: skip
        SamplingParams(**common, capture=Capture(["blocks.2.attn.hook_pattern"], positions="all")),
        SamplingParams(**common, interventions=[Steer("blocks.0.hook_resid_post", torch.randn(D, generator=g), scale=4.0)],
                       capture=Capture(["blocks.2.hook_resid_post"], positions="generated")),  # fmt: skip
        SamplingParams(**common, interventions=[Ablate("blocks.1.hook_attn_out", torch.randn(D, generator=g))],
                       capture=Capture(["blocks.1.hook_resid_mid"], positions="generated")),  # fmt: skip
        SamplingParams(**common, interventions=[Steer("blocks.1.attn.hook_z", torch.randn(head_dim, generator=g),
                                                      heads=[1], scale=8.0)]),  # fmt: skip
        SamplingParams(**common, interventions=[Clamp("blocks.1.hook_resid_post", sae, 3, 5.0)], capture=Capture(sae=sae, top_k=4)),
    ]
    lengths = [5, 9, 3, 14, 7, 4, 11]  # crosses block boundaries; one prompt shorter than a block
    return [(torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist(), p) for n, p in zip(lengths, params)]


def _run(llm: LLM, static: bool, seed: int):
    llm.runner.static_decode = static
    try:
        requests = _requests(seed, llm.config.head_dim)
        return llm.generate([t for t, _ in requests], [p for _, p in requests], use_tqdm=False)
    finally:
        llm.runner.static_decode = False


def _values(out) -> dict[str, torch.Tensor]:
    values = {f"act:{k}": v for k, v in out.activations.items()}
    for name, (ids, acts) in out.sae_features.items():
        values[f"sae_ids:{name}"], values[f"sae:{name}"] = ids.float(), acts
    return values


def test_static_decode_equals_the_ordinary_step(llm):
    before = llm.runner.graph_stats.static_eager_steps
    eager, static = _run(llm, False, 1), _run(llm, True, 1)
    assert llm.runner.graph_stats.static_eager_steps - before >= 10  # the decode steps took the static path
    for a, b in zip(eager, static):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        va, vb = _values(a), _values(b)
        assert va.keys() == vb.keys()
        for name in va:
            assert va[name].shape == vb[name].shape, name
            assert rel_err(vb[name], va[name]) < 1e-5, name


def test_static_decode_batches_other_sizes_and_preempts(llm):
    """Batches of every bucket up to max_num_seqs, sequences joining and finishing between steps."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, COMMON["vocab_size"], (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (11,), generator=g)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in torch.randint(1, 15, (11,), generator=g)]
    llm.runner.static_decode = True
    try:
        static = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.runner.static_decode = False
    eager = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in static] == [o.outputs[0].token_ids for o in eager]
