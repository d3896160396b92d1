"""The forward compiles whole, taps and interventions included: one packed engine step with prefill
and decode rows goes through torch.compile(model.forward, fullgraph=True) with no graph break, gives
the eager values, and a later step with other requests, rows and vectors (buffers of the same sizes)
reuses the compiled graph instead of recompiling.

The backend is "aot_eager": dynamo's capture and AOTAutograd's functionalisation (where in-place
writes to the KV cache and the taps' buffers must survive), without the C++ code generation that
would take minutes on two cores.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from test_parity_bamba import bamba_config
from test_parity_bloom import CONFIGS as BLOOM_CONFIGS
from test_parity_gemma4 import CONFIGS as GEMMA4_CONFIGS
from test_parity_qwen3_5 import text_config as qwen3_5_config
from transformers import Cohere2Config, GptOssConfig, LlamaConfig, OlmoeConfig

from vlens import LLM, SAE, Ablate, Capture, Clamp, SamplingParams, Steer
from vlens.context import get_context
from vlens.layers.slot_states import SlotStates

FAMILIES = {  # family -> (config, a hook of its MLP to capture)
    "llama": (lambda: LlamaConfig(**COMMON, num_key_value_heads=2), "blocks.2.mlp.hook_post"),
    # routed experts (as Mixtral's), q/k normalised over the whole projection, q/k/v clamped
    "olmoe": (
        lambda: OlmoeConfig(**COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, clip_qkv=0.5),
        "blocks.2.mlp.hook_expert_ids",  # int64 rows
    ),
    # attention sinks in the softmax, experts with biases and a clamped SwiGLU, YaRN
    "gpt_oss": (
        lambda: GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=7),
        "blocks.2.mlp.hook_router_logits",
    ),
    # rotary by pairs on the windowed layers, none on the other; one bias-free LayerNorm, the parallel residual
    "cohere2": (
        lambda: Cohere2Config(**COMMON, num_key_value_heads=2, sliding_window=7, logit_scale=0.25,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "blocks.2.mlp.hook_post",
    ),
    # layers of two head sizes (their caches apart), keys that are values, values normalised, layer scalars,
    # per-layer embeddings, layers that attend to an earlier layer's keys and values
    "gemma4": (GEMMA4_CONFIGS["gemma4_per_layer_shared_kv"], "blocks.2.mlp.hook_post"),
    # ALiBi's biases made on the device in the forward, the written-out attention
    "bloom": (BLOOM_CONFIGS["bloom"], "blocks.2.mlp.hook_post"),
    # a gated delta net (its chunks' layout planned by the runner, its states read and written through index
    # buffers) after two gated attention layers
    "qwen3_5": (
        lambda: qwen3_5_config(layer_types=["full_attention", "full_attention", "linear_attention"]),
        "blocks.2.linear_attn.hook_z",
    ),
    # a Mamba 2 mixer (its chunked scan and its SSM states through the same buffers) after two attention layers
    "bamba": (lambda: bamba_config(attn_layer_indices=[0, 1]), "blocks.2.mamba.hook_ssm_out"),
}
D = COMMON["hidden_size"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def llm(request, tmp_path_factory) -> LLM:
    config, mlp_hook = FAMILIES[request.param]
    path = build(config(), tmp_path_factory.mktemp("compile"), request.param)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4)
    llm.mlp_hook = mlp_hook
    return llm


class CompiledForward:
    """Stands in for the runner's forward: runs the step eagerly, explains and runs it compiled, and
    records what a test asserts (compiles, differences from eager)."""

    def __init__(self, model):
        torch._dynamo.reset()  # (what an earlier test compiled, of another model, would mark shapes dynamic)
        self.model, self.compiles, self.errors, self.taps = model, 0, [], []
        aot_eager = torch._dynamo.lookup_backend("aot_eager")

        def counting(gm, example_inputs):
            self.compiles += 1
            return aot_eager(gm, example_inputs)

        self.compiled = torch.compile(model.forward, fullgraph=True, backend=counting)

    def _gathered(self) -> dict[str, torch.Tensor]:
        return {name: t.gather_out.clone() for name, t in get_context().taps.items() if t.gather_out is not None}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.taps.append(sorted(get_context().taps))
        # (linear-attention layers update their sequences' states: each run of the step starts from the same ones)
        states = [(m.state, m.state.clone()) for m in self.model.modules() if isinstance(m, SlotStates)]
        again = lambda: [state.copy_(saved) for state, saved in states]  # noqa: E731
        eager = self.model(ids)
        eager_rows = self._gathered()
        again()
        out = self.compiled(ids)  # fullgraph=True: a graph break in any step raises here, naming its cause
        rows = self._gathered()
        self.errors.append(max([rel_err(out, eager)] + [rel_err(rows[n].float(), eager_rows[n].float()) for n in rows]))
        return out


def _sae(g: torch.Generator) -> SAE:
    """A small JumpReLU SAE at blocks.1.hook_resid_post."""
    d_sae = 32
    return SAE(
        W_enc=torch.randn(D, d_sae, generator=g), b_enc=torch.randn(d_sae, generator=g), W_dec=torch.randn(d_sae, D, generator=g),
        b_dec=torch.randn(D, generator=g), threshold=torch.rand(d_sae, generator=g), architecture="jumprelu",
        hook="blocks.1.hook_resid_post",
    )  # fmt: skip


def _transcoder(g: torch.Generator) -> SAE:
    """A small transcoder from blocks.0.ln2.hook_out to blocks.0.hook_mlp_out."""
    d_sae = 32
    return SAE(
        W_enc=torch.randn(D, d_sae, generator=g), b_enc=torch.randn(d_sae, generator=g), W_dec=torch.randn(d_sae, D, generator=g),
        b_dec=torch.randn(D, generator=g), hook="blocks.0.ln2.hook_out", hook_out="blocks.0.hook_mlp_out",
        apply_b_dec_to_input=False,
    )  # fmt: skip


def _mixed_step(llm: LLM, forward: CompiledForward, seed: int, tapped: bool) -> None:
    """Prefill two requests eagerly, then run one compiled step in which they decode while two new
    requests prefill. With `tapped`, three requests capture at mixed positions, one steers, one
    ablates, one clamps an SAE latent and one reads SAE features; `seed` changes the tokens, rows,
    vectors and SAE but not the sizes."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    vector = lambda: torch.randn(D, generator=g)  # noqa: E731
    sae = _sae(g)
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    if tapped:
        first = [
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                           capture=Capture(["blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern"], positions="generated")),
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, interventions=[Steer("blocks.0.hook_resid_post", vector(), positions="generated")],
                           capture=Capture(sae=sae, top_k=4)),
        ]  # fmt: skip
        at = [seed % 3, 3]  # other rows in each round, the same number of them
        second = [
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, capture=Capture(["blocks.0.attn.hook_z", "hook_embed"], positions=at),
                           interventions=[Clamp("blocks.1.hook_resid_post", sae, seed % 4, float(seed)),
                                          Clamp("blocks.0.hook_mlp_out", _transcoder(g), seed % 4, float(seed))]),
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, capture=Capture(llm.mlp_hook, positions="all"),
                           interventions=[Ablate("blocks.1.hook_attn_out", vector(), positions=[1, 2])]),
        ]  # fmt: skip
    else:
        first, second = [plain, plain], [plain, plain]
    engine = llm.engine
    engine.runner.forward = llm.model  # the first step, all prefill, runs eagerly
    engine.add_requests([_request(tokens(5), first[0]), _request(tokens(7), first[1])])
    engine.step()
    engine.runner.forward = forward
    engine.add_requests([_request(tokens(6), second[0]), _request(tokens(4), second[1])])
    engine.step()
    engine.runner.forward = llm.model
    for request_id in list(engine._requests):
        engine.abort(request_id)


def _request(ids, params):
    from vlens.engine.llm_engine import NewRequest

    return NewRequest(ids, params)


@pytest.mark.parametrize("tapped", [False, True], ids=["nothing_captured", "captures_steer_ablate"])
def test_compile_whole_forward_no_recompile(llm, tapped):
    llm.engine.runner.taps.fixed_shapes = True
    forward = CompiledForward(llm.model)
    try:
        _mixed_step(llm, forward, seed=1, tapped=tapped)
        assert forward.compiles == 1
        _mixed_step(llm, forward, seed=2, tapped=tapped)
    finally:
        llm.engine.runner.taps.fixed_shapes = False
    assert forward.compiles == 1, "a step with other requests, rows and vectors recompiled"
    assert max(forward.errors) < 1e-5
    tapped_sites = ["blocks.0.attn.hook_z", "blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern",
                    "blocks.1.hook_attn_out", "blocks.1.hook_resid_post", llm.mlp_hook, "hook_embed",
                    "blocks.0.ln2.hook_out", "blocks.0.hook_mlp_out"]  # fmt: skip  (a transcoder reads, then writes)
    assert forward.taps == [sorted(tapped_sites) if tapped else []] * 2
