"""Direct logit attribution with TransformerLens's calls (vlens.attribution, vlens.hooked_weights): the weights
in TransformerLens's shapes equal its own, built from the same HF weights; per-head results plus b_O are
hook_attn_out, per-neuron results plus b_out hook_mlp_out; decompose_resid's and get_full_resid_decomposition's
pieces sum to the stream; and, the check that matters, the logit attributions of every component sum to the
model's logit (difference), family by family, in float32."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoConfig,
    PhiConfig,
)
from transformers.activations import ACT2FN

from vlens import HookedLM
from vlens.distributed.parallel import Parallel

LOGIT_TOL = 1e-4  # the logit, rebuilt from its components (float32), relative to the largest logit compared
STREAM_TOL = 1e-4  # the stream, rebuilt from every head and neuron (float32)
FAMILIES = {
    "llama_gqa_biases": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "mixtral": lambda: MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "gpt2": lambda: GPT2Config(vocab_size=COMMON["vocab_size"], n_embd=64, n_layer=3, n_head=4, n_positions=128),
    "pythia_parallel": lambda: GPTNeoXConfig(**COMMON),
    "gemma2": lambda: Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                   attn_logit_softcapping=30.0, final_logit_softcapping=20.0),
    "olmo1": lambda: OlmoConfig(**COMMON, clip_qkv=0.5),  # LayerNorms of no weight or bias
    # the parallel residual with one norm for both sublayers; biases everywhere, the unembedding's too
    "phi": lambda: PhiConfig(**COMMON, hidden_act="gelu_new", pad_token_id=0, bos_token_id=1, eos_token_id=2),
}  # fmt: skip
PARALLEL = ("pythia_parallel", "phi")  # the MLP reads the layer's input: no "MLP input" stream to decompose
DENSE = ("gpt2", "pythia_parallel", "phi")  # act(x @ W_in + b_in), no W_gate


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, HookedLM]:
    path = build(FAMILIES[request.param](), tmp_path_factory.mktemp(request.param), request.param)
    return request.param, HookedLM(path, dtype="float32", device="cpu")


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two texts of 11 and 6 tokens, right-padded (a mask says which are real), and a token to attribute
    at each position."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 11), generator=g)
    mask = torch.arange(11)[None, :] < torch.tensor([11, 6])[:, None]
    return tokens, mask, torch.randint(0, COMMON["vocab_size"], (2, 11), generator=g)


def _bias_term(norm: torch.nn.Module, directions: torch.Tensor) -> torch.Tensor:
    """What a LayerNorm's bias adds to the dot product with `directions` (no component's; RMSNorm: none)."""
    bias = getattr(norm, "bias", None)
    return torch.zeros(directions.shape[:-1]) if bias is None else (directions * bias.detach()).sum(-1)


def _attributable_logit(hooked: HookedLM, cache, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The logit of `tokens` that the components' attributions sum to: less what the final LayerNorm's bias and
    the unembedding's (Phi's b_U) add, and before Gemma's soft-cap."""
    if hooked.cfg.final_softcap is not None:
        logits = cache["ln_final.hook_out"] @ hooked.W_U + hooked.b_U
    directions = hooked.tokens_to_residual_directions(tokens)
    constant = _bias_term(hooked.llm.model.final_norm, directions) + hooked.b_U[tokens]
    return logits.gather(-1, tokens[..., None])[..., 0] - constant


def _close(got: torch.Tensor, expected: torch.Tensor, rows: torch.Tensor) -> bool:
    """Within LOGIT_TOL of the largest expected value, on the real rows."""
    return (got - expected)[rows].abs().max() <= LOGIT_TOL * expected[rows].abs().max().clamp_min(1.0)


def test_logit_attributions_sum_to_the_logit(family):
    name, hooked = family
    tokens, mask, targets = _batch()
    logits, cache = hooked.run_with_cache(tokens, attention_mask=mask)
    stack, labels = cache.decompose_resid(return_labels=True)
    n = hooked.cfg.num_layers
    assert labels[:2] == (["embed", "pos_embed"] if name == "gpt2" else ["embed", "0_attn_out"])
    assert labels[-2:] == [f"{n - 1}_attn_out", f"{n - 1}_mlp_out"] and len(labels) == stack.shape[0]
    assert rel_err(stack.sum(0), cache["resid_post", -1]) <= 1e-5  # the pieces are the whole stream
    expected = _attributable_logit(hooked, cache, logits, targets)
    attrs = cache.logit_attrs(stack, targets)
    assert attrs.shape == (len(labels), 2, 11)
    assert _close(attrs.sum(0), expected, mask)
    assert not attrs[:, ~mask].any()  # past a text's end: zeros, not 0 / 0
    wrong = targets.flip(1)
    diff = cache.logit_attrs(stack, targets, incorrect_tokens=wrong).sum(0)
    assert _close(diff, expected - _attributable_logit(hooked, cache, logits, wrong), mask)
    if name == "gemma2":
        with pytest.raises(ValueError, match=r"^Gemma2ForCausalLM: per-head results are not defined: its post-attention norm"):
            cache.stack_head_results()
        return
    heads, labels = cache.stack_head_results(return_labels=True, incl_remainder=True)
    h = hooked.cfg.num_heads
    assert labels[: h + 1] == [f"L0H{i}" for i in range(h)] + ["L1H0"] and labels[-1] == "remainder"
    assert heads.shape == (n * h + 1, 2, 11, hooked.cfg.hidden_size)
    assert _close(cache.logit_attrs(heads, targets).sum(0), expected, mask)
    for layer in range(n):  # each layer's heads and its b_O are what the attention adds
        total = cache["result", layer].sum(-2) + hooked.b_O[layer]
        assert rel_err(total[mask], cache["attn_out", layer][mask]) <= 1e-5


def test_the_stack_through_a_layers_norms(family):
    """apply_ln_to_stack at a layer's norms: the components of its input, each divided by the stream's cached
    scale and times the weight, sum to the norm's output less its bias; NeoX's parallel MLP reads the layer
    input, so there is no "MLP input" to decompose."""
    name, hooked = family
    tokens, mask, _ = _batch()
    _, cache = hooked.run_with_cache(tokens, attention_mask=mask)
    block = hooked.llm.model.layers[1]
    pre = cache.decompose_resid(layer=1)
    assert rel_err(pre.sum(0), cache["resid_pre", 1]) <= 1e-5
    for norm, stack, mlp_input, hook in ((block.ln1, pre, False, "ln1"), (block.ln2, pre, True, "ln2")):
        if hook == "ln2" and name not in PARALLEL:
            stack = cache.decompose_resid(layer=1, mlp_input=True)
            assert rel_err(stack.sum(0), cache["resid_mid", 1]) <= 1e-5
        normed = cache.apply_ln_to_stack(stack, 1, mlp_input=mlp_input).sum(0)
        if hasattr(norm, "bias"):  # LayerNorm's bias is a constant of the norm, no component's
            normed = normed + norm.bias.detach()
        assert rel_err(normed[mask], cache[f"blocks.1.{hook}.hook_out"][mask]) <= 1e-5, hook
    if name in PARALLEL:
        with pytest.raises(ValueError, match=r"^mlp_input: \w+ForCausalLM with a parallel residual runs"):
            cache.decompose_resid(layer=1, mlp_input=True)


def test_mlp_weights_give_the_mlp_by_transformer_lens_equations(family):
    """Over the cached ln2 output, act(x @ W_in + b_in) (GPT-2, NeoX) or act(x @ W_gate) * (x @ W_in) + b_in
    (gated) is hook_post, and hook_post @ W_out + b_out is hook_mlp_out; routed experts have no such weights
    and say so, leaving the attention's."""
    name, hooked = family
    tokens, mask, _ = _batch()
    _, cache = hooked.run_with_cache(tokens, attention_mask=mask)
    if name == "mixtral":
        reads = ((0, lambda: hooked.W_in), (1, lambda: hooked.blocks[1].mlp), (0, lambda: hooked.accumulated_bias(2)))
        for layer, read in reads:
            with pytest.raises(ValueError, match=rf"^MixtralForCausalLM: layer {layer}'s MLP is 4 routed experts"):
                read()
        assert hooked.blocks[1].attn.W_O.shape == (4, 16, 64)
        assert not hooked.accumulated_bias(2, include_mlp_biases=False).any()  # no biases anywhere
        return
    d_mlp = hooked.cfg.d_mlp
    assert hooked.W_in.shape == (3, 64, d_mlp) and hooked.W_out.shape == (3, d_mlp, 64)
    assert (hooked.W_gate is None) == (name in DENSE)  # as TransformerLens's W_gate
    x, mlp, act = cache["blocks.1.ln2.hook_out"], hooked.blocks[1].mlp, ACT2FN[hooked.cfg.hidden_act]
    if mlp.W_gate is None:
        post = act(x @ mlp.W_in + mlp.b_in)
    elif name == "llama_gqa_biases":  # HF's biases are before the product, TransformerLens's b_in after it
        with pytest.raises(ValueError, match=r"^b_in: LlamaForCausalLM with mlp_bias adds its biases to x @ W_gate"):
            hooked.b_in
        gate_bias, up_bias = hooked.llm.model.layers[1].mlp.gate_up_proj.bias.detach().chunk(2)
        post = act(x @ mlp.W_gate + gate_bias) * (x @ mlp.W_in + up_bias)
    else:
        post = act(x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in
    assert rel_err(post[mask], cache["post", 1][mask]) <= 1e-5
    with torch.no_grad():
        out = cache["post", 1] @ mlp.W_out + mlp.b_out
        if name == "gemma2":  # its post-feedforward norm stands between the MLP and hook_mlp_out
            out = hooked.llm.model.layers[1].post_feedforward_layernorm(out)
    assert rel_err(out[mask], cache["mlp_out", 1][mask]) <= 1e-5
    assert torch.equal(hooked.W_out[1], mlp.W_out) and torch.equal(hooked.b_out[1], mlp.b_out)


def test_full_resid_decomposition_sums_to_the_stream_and_the_logit(family):
    """Every head's result, every neuron's, the embeddings and the accumulated biases: the stream entering a layer
    (or its MLP) and, through the norm, its output; unembedded, the logit. Refused by name where a piece is not
    the stream's: Gemma's post-norms, NeoX's parallel MLP input, MoE neurons (their whole mlp_out is exact)."""
    name, hooked = family
    tokens, mask, targets = _batch()
    logits, cache = hooked.run_with_cache(tokens, attention_mask=mask)
    if name == "gemma2":
        with pytest.raises(ValueError, match=r"^Gemma2ForCausalLM: per-head results are not defined"):
            cache.get_full_resid_decomposition(expand_neurons=False)
        with pytest.raises(ValueError, match=r"^Gemma2ForCausalLM: per-neuron results are not defined: its post-feedfor"):
            cache.stack_neuron_results(1)
        return
    expand = name != "mixtral"
    if not expand:
        with pytest.raises(ValueError, match=r"^MixtralForCausalLM: layer 0's MLP is 4 routed experts, chosen per"):
            cache.get_full_resid_decomposition()
    n, h, d_mlp = hooked.cfg.num_layers, hooked.cfg.num_heads, hooked.cfg.d_mlp
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=expand, return_labels=True)
    mlps = [f"L{i}N{j}" for i in range(n) for j in range(d_mlp)] if expand else [f"{i}_mlp_out" for i in range(n)]
    embeds = ["embed", "pos_embed"] if name == "gpt2" else ["embed"]
    assert labels == [f"L{i}H{j}" for i in range(n) for j in range(h)] + mlps + embeds + ["bias"]
    assert stack.shape == (len(labels), 2, 11, 64) and not stack[:, ~mask].any()
    assert rel_err(stack.sum(0), cache["resid_post", -1]) <= STREAM_TOL
    assert _close(cache.logit_attrs(stack, targets).sum(0), _attributable_logit(hooked, cache, logits, targets), mask)
    block = hooked.llm.model.layers[1]
    for mlp_input, hook, norm in ((False, "resid_pre", "ln1"), (True, "resid_mid", "ln2")):
        if mlp_input and name in PARALLEL:
            with pytest.raises(ValueError, match=r"^mlp_input: \w+ForCausalLM with a parallel residual runs"):
                cache.get_full_resid_decomposition(1, mlp_input=True)
            continue
        part = cache.get_full_resid_decomposition(1, mlp_input, expand_neurons=expand)
        assert rel_err(part.sum(0)[mask], cache[hook, 1][mask]) <= STREAM_TOL, hook
        normed = cache.get_full_resid_decomposition(1, mlp_input, expand_neurons=expand, apply_ln=True).sum(0)
        if hasattr(getattr(block, norm), "bias"):  # LayerNorm's bias is a constant of the norm, no component's
            normed = normed + getattr(block, norm).bias.detach()
        assert rel_err(normed[mask], cache[f"blocks.1.{norm}.hook_out"][mask]) <= STREAM_TOL, norm
    if expand:  # each layer's neurons and its b_out are what the MLP adds
        neurons = cache.stack_neuron_results(-1)
        for layer in range(n):
            total = neurons[layer * d_mlp : (layer + 1) * d_mlp].sum(0) + hooked.b_out[layer]
            assert rel_err(total[mask], cache["mlp_out", layer][mask]) <= 1e-5


def _transformer_lens(name: str, path: str, hf):
    """TransformerLens's HookedTransformer from the same HF weights, unprocessed (from_pretrained_no_processing
    refuses names it does not know): its config conversion (GPT-2's reads a field transformers 5 dropped, so
    that config is written out) and its weight conversion."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.loading_from_pretrained import convert_hf_model_config
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights

    if name == "gpt2":
        cfg = HookedTransformerConfig(n_layers=3, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=COMMON["vocab_size"],
                                      n_ctx=128, act_fn="gelu_new", normalization_type="LN")  # fmt: skip
        convert = convert_gpt2_weights
    else:
        settings = convert_hf_model_config(path)
        settings.pop("tokenizer_name")
        cfg, convert = HookedTransformerConfig(**settings, dtype=torch.float32), convert_llama_weights
    model = HookedTransformer(cfg)
    model.load_state_dict(convert(hf, cfg), strict=False)
    return model


TL_FAMILIES = {
    "llama_gqa": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "gpt2": FAMILIES["gpt2"],
}


@pytest.mark.parametrize("name", list(TL_FAMILIES))
def test_weights_and_attributions_equal_transformer_lens_built_from_the_same_weights(name, tmp_path, monkeypatch):
    path = build(TL_FAMILIES[name](), tmp_path, "checkpoint")  # TransformerLens reads "llama" in a path as a name
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tl = _transformer_lens(name, path, hf)
    hooked = HookedLM(path, dtype="float32", device="cpu")
    weights = ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_U", "W_E", "W_in", "W_out", "b_in", "b_out"]
    for weight in weights + (["W_pos"] if name == "gpt2" else ["W_gate"]):  # TransformerLens's shapes: W_K [layers,
        assert torch.equal(getattr(hooked, weight), getattr(tl, weight).detach()), weight  # heads, d_model, d_head]
    assert hooked.W_gate is None if name == "gpt2" else hooked.W_gate.shape == (3, 64, 96)
    assert torch.equal(hooked.blocks[1].attn.W_O, tl.blocks[1].attn.W_O.detach())
    assert torch.equal(hooked.blocks[1].mlp.W_out, tl.blocks[1].mlp.W_out.detach())
    for ours, theirs in ((hooked.QK, tl.QK), (hooked.OV, tl.OV), (hooked.blocks[2].attn.OV, tl.blocks[2].attn.OV)):
        assert torch.equal(ours.A, theirs.A.detach()) and torch.equal(ours.B, theirs.B.detach())
        assert rel_err(ours.AB, theirs.AB.detach()) <= 1e-6  # (TransformerLens's FactoredMatrix, as there)
    # a logit lens, TransformerLens's way: model.unembed(model.ln_final(resid)); at the last layer, the logits
    text = torch.tensor([[3, 14, 15, 92, 65]])
    logits, streams = hooked.run_with_cache(text, names_filter="blocks.*.hook_resid_post")
    with torch.no_grad():
        theirs_lens = tl.unembed(tl.ln_final(streams["resid_post", 1]))
    assert rel_err(hooked.unembed(hooked.ln_final(streams["resid_post", 1])), theirs_lens) <= 1e-5
    assert rel_err(hooked.unembed(hooked.ln_final(streams["resid_post", -1])), logits) <= 1e-6
    with monkeypatch.context() as without:  # (where TransformerLens is not installed)
        without.setitem(sys.modules, "transformer_lens", None)
        with pytest.raises(ImportError, match=r"^QK / OV: TransformerLens's FactoredMatrix: pip install transformer-lens"):
            hooked.OV
    for layer, mlp_input in ((3, False), (2, True)):
        assert rel_err(hooked.accumulated_bias(layer, mlp_input), tl.accumulated_bias(layer, mlp_input)) <= 1e-6
    if name == "llama_gqa":  # the KV heads themselves, as TransformerLens stores them under grouped-query attention
        assert hooked.blocks[2].attn._W_K.shape == (2, 64, 16)
        assert torch.equal(hooked.blocks[2].attn._W_V, tl.blocks[2].attn._W_V.detach())
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    _, cache = hooked.run_with_cache(tokens)
    _, tl_cache = tl.run_with_cache(tokens)
    for ours, theirs in (
        (cache.stack_head_results(return_labels=True, pos_slice=-1), tl_cache.stack_head_results(return_labels=True, pos_slice=-1)),
        (cache.decompose_resid(return_labels=True), tl_cache.decompose_resid(return_labels=True)),
        (cache.get_full_resid_decomposition(return_labels=True),
         tl_cache.get_full_resid_decomposition(return_labels=True)),
        (cache.get_full_resid_decomposition(1, True, False, pos_slice=-1, return_labels=True),
         tl_cache.get_full_resid_decomposition(1, True, False, pos_slice=-1, return_labels=True)),
        (cache.stack_neuron_results(2, -1, [3, 5], return_labels=True, incl_remainder=True),
         tl_cache.stack_neuron_results(2, -1, [3, 5], return_labels=True, incl_remainder=True)),
    ):  # fmt: skip
        assert ours[1] == theirs[1] and rel_err(ours[0], theirs[0]) <= 1e-5
    cache.compute_head_results()
    tl_cache.compute_head_results()
    assert rel_err(cache["result", 1], tl_cache["result", 1]) <= 1e-5
    direction = tl.W_U[:, 7].detach()
    for kwargs in ({"neuron_slice": [3, 5], "pos_slice": -1}, {"project_output_onto": direction}):
        ours, theirs = cache.get_neuron_results(-2, **kwargs), tl_cache.get_neuron_results(1, **kwargs)
        assert ours.shape == theirs.shape and rel_err(ours, theirs) <= 1e-5, kwargs
    second, tl_second = cache.apply_slice_to_batch_dim(1), tl_cache.apply_slice_to_batch_dim(1)
    assert torch.equal(second["resid_post", 1], cache["resid_post", 1][1])
    assert rel_err(second.decompose_resid(), tl_second.decompose_resid()) <= 1e-5  # (one text, no batch dim)
    assert set(cache.cache_dict) == set(cache) and cache.cache_dict["hook_embed"] is cache["hook_embed"]
    try:
        cache.toggle_autodiff()  # (TransformerLens's switch of torch's global gradient mode: off)
        assert not torch.is_grad_enabled()
    finally:
        cache.toggle_autodiff(True)
    stack = cache.decompose_resid()
    # TransformerLens divides by the cached scale only (its fold_ln moves the norm's weight into W_U); vlens
    # applies the weight too, as nothing is folded
    weight = tl.ln_final.w.detach()
    assert rel_err(cache.apply_ln_to_stack(stack), tl_cache.apply_ln_to_stack(stack) * weight) <= 1e-5
    tl.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    _, folded = tl.run_with_cache(tokens)
    theirs = folded.logit_attrs(folded.decompose_resid(), tokens)  # folded: its attributions are the logit's too
    assert rel_err(cache.logit_attrs(stack, tokens), theirs) <= 1e-5


def test_heads_by_hand_from_hf_modules(tmp_path):
    """hook_result is z_h @ W_O[h], W_O[h] head h's columns of HF's o_proj; the queries' biases are HF's."""
    path = build(FAMILIES["llama_gqa_biases"](), tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hooked = HookedLM(path, dtype="float32", device="cpu")
    tokens, _, _ = _batch()
    _, cache = hooked.run_with_cache(tokens)
    with pytest.raises(KeyError, match=r"'blocks.2.attn.hook_result' is not in the cache; cache.compute_head_results\(\)"):
        cache["result", 2]
    cache.compute_head_results()  # as in TransformerLens
    attn = hf.model.layers[2].self_attn
    d = hooked.cfg.head_dim
    z = cache["z", 2]
    for h in range(hooked.cfg.num_heads):
        by_hand = z[..., h, :] @ attn.o_proj.weight[:, h * d : (h + 1) * d].T.detach()
        assert rel_err(cache["result", 2][..., h, :], by_hand) <= 1e-6
    assert torch.equal(hooked.b_O[2], attn.o_proj.bias.detach())
    assert torch.equal(hooked.b_Q[2], attn.q_proj.bias.detach().view(4, d))
    assert torch.equal(hooked.b_K[2], attn.k_proj.bias.detach().view(2, d).repeat_interleave(2, 0))
    assert torch.equal(hooked.blocks[2].attn._b_V, attn.v_proj.bias.detach().view(2, d))
    assert torch.equal(hooked.W_E[tokens], cache["hook_embed"])
    mlp = hf.model.layers[2].mlp
    assert torch.equal(hooked.W_in[2], mlp.up_proj.weight.detach().T)
    assert torch.equal(hooked.W_gate[2], mlp.gate_proj.weight.detach().T)
    assert torch.equal(hooked.blocks[2].mlp.W_out, mlp.down_proj.weight.detach().T)
    assert torch.equal(hooked.b_out[2], mlp.down_proj.bias.detach())
    neurons, labels = cache.stack_neuron_results(3, pos_slice=-1, neuron_slice=[5, 7], return_labels=True)
    assert labels == ["L0N5", "L0N7", "L1N5", "L1N7", "L2N5", "L2N7"]
    by_hand = cache["post", 2][:, -1, 5, None] * mlp.down_proj.weight[:, 5].detach()  # hook_post_n * W_out[n]
    assert rel_err(neurons[4], by_hand) <= 1e-6
    assert torch.equal(neurons[1], cache.stack_neuron_results(3, pos_slice=-1)[7])
    assert cache.stack_head_results(layer=0).shape == (0, 2, 11, 64)  # no layer below 0: no heads
    assert cache.stack_neuron_results(0).shape == (0, 2, 11, 64)  # nor neurons
    assert torch.equal(cache.stack_head_results(layer=0, incl_remainder=True)[0], cache["resid_pre", 0])


def test_logit_difference_on_smollm2(smol4_path):
    """The IOI-style cell on real weights: a logit difference at each text's last position, its heads and
    layers summed, against the model's own logits; the same through run_with_cache's pos_slice."""
    hooked = HookedLM(str(smol4_path), dtype="float32", device="cpu")
    texts = ["The capital of France is", "Paris is a city in Europe, and London is the capital of"]
    logits, cache = hooked.run_with_cache(texts)
    answers, wrong = hooked.to_single_token(" Paris"), hooked.to_single_token(" London")
    last = [len(hooked.to_tokens(t)[0]) - 1 for t in texts]
    final = logits[torch.arange(2), last]
    expected = final[:, answers] - final[:, wrong]
    for stack in (
        cache.decompose_resid(pos_slice=-1), cache.stack_head_results(pos_slice=-1, incl_remainder=True),
        cache.get_full_resid_decomposition(pos_slice=-1),
    ):  # fmt: skip
        diff = cache.logit_attrs(stack, " Paris", incorrect_tokens=" London", pos_slice=-1)
        assert diff.shape == (stack.shape[0], 2)
        assert (diff.sum(0) - expected).abs().max() <= LOGIT_TOL * expected.abs().max()
    stack, labels = cache.stack_head_results(pos_slice=-1, return_labels=True)
    assert len(labels) == 4 * 9 and labels[-1] == "L3H8"  # SmolLM2: 9 query heads over 3 KV heads
    assert hooked.W_K.shape == (4, 9, 576, 64) and hooked.blocks[0].attn._W_K.shape == (3, 576, 64)
    _, sliced = hooked.run_with_cache(texts, pos_slice=-1)
    ours = sliced.logit_attrs(sliced.decompose_resid(), " Paris", incorrect_tokens=" London")
    assert rel_err(ours, cache.logit_attrs(cache.decompose_resid(pos_slice=-1), " Paris", " London", pos_slice=-1)) <= 1e-6
    with pytest.raises(ValueError, match=r"^pos_slice: this cache holds only positions -1 of each text"):
        sliced.decompose_resid(pos_slice=-1)
    lens = cache.accumulated_resid(apply_ln=True, pos_slice=-1)  # on a cache of the last positions too
    assert rel_err(sliced.accumulated_resid(apply_ln=True), lens) <= 1e-6
    _, one = hooked.run_with_cache(texts[0], remove_batch_dim=True)
    alone = one.logit_attrs(one.decompose_resid(), answers)  # no batch dimension: [components, positions]
    assert alone.shape == (9, last[0] + 1)
    assert rel_err(alone, cache.logit_attrs(cache.decompose_resid(), answers)[:, 0, : last[0] + 1]) <= 1e-6


def test_bad_input_names_the_problem(tmp_path, monkeypatch):
    path = build(TL_FAMILIES["llama_gqa"](), tmp_path, "llama")
    hooked = HookedLM(path, dtype="float32", device="cpu")
    tokens, _, _ = _batch()
    _, cache = hooked.run_with_cache(tokens)
    stack = cache.decompose_resid()
    with pytest.raises(ValueError, match=r"^layer: 4 is not in 0\.\.3 \(n_layers, -1 or None"):
        cache.decompose_resid(layer=4)
    with pytest.raises(ValueError, match=r"^mode: 'mlps' is not one of all, attn, mlp"):
        cache.decompose_resid(mode="mlps")
    with pytest.raises(ValueError, match=r"^mlp_input: layer 3 \(-1, None\) is the final norm's input"):
        cache.apply_ln_to_stack(stack, mlp_input=True)
    with pytest.raises(ValueError, match=r"^recompute_ln: True goes with the final norm \(layer None, -1 or 3\)"):
        cache.apply_ln_to_stack(cache.decompose_resid(1), 1, recompute_ln=True)
    with pytest.raises(ValueError, match=r"^incorrect_tokens: shape \(2,\) differs from tokens' \(2, 11\)"):
        cache.logit_attrs(stack, tokens, incorrect_tokens=tokens[:, 0])
    with pytest.raises(ValueError, match=r"^tokens: token ids must be in 0\.\.299"):
        cache.logit_attrs(stack, 300)
    with pytest.raises(ValueError, match=r"^tokens: token ids are integers; got a tensor of torch.float32"):
        hooked.tokens_to_residual_directions(torch.tensor([1.0, 2.0]))
    with pytest.raises(AttributeError, match=r"^W_pos: LlamaForCausalLM has no learned position embedding"):
        hooked.W_pos
    _, partial = hooked.run_with_cache(tokens, names_filter="blocks.*.hook_attn_out")
    with pytest.raises(KeyError, match=r"decompose_resid needs 'hook_embed', which this cache lacks"):
        partial.decompose_resid()
    with pytest.raises(KeyError, match=r"per-head results needs 'blocks.0.attn.hook_z'"):
        partial.stack_head_results()
    with pytest.raises(KeyError, match=r"per-neuron results needs 'blocks.0.mlp.hook_post'"):
        partial.stack_neuron_results(1)
    with pytest.raises(ValueError, match=r"^neuron_slice: 96 is not an int, slice or list of ints in 0\.\.95"):
        cache.stack_neuron_results(1, neuron_slice=96)
    with pytest.raises(ValueError, match=r"^layer: 4 is not in 0\.\.3 \(n_layers, -1 or None"):
        hooked.accumulated_bias(4)
    with pytest.raises(ValueError, match=r"^mlp_input: layer 3 \(-1, None\) is the final norm's input"):
        hooked.accumulated_bias(3, mlp_input=True)
    monkeypatch.setattr(hooked.llm.model, "cfg", dataclasses.replace(hooked.llm.model.cfg, parallel=Parallel(0, 2)))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 2: the weight attributes"):
        hooked.W_U


def test_to_single_token(smol4_path):
    hooked = HookedLM(str(smol4_path), dtype="float32", device="cpu")
    assert hooked.to_str_tokens(torch.tensor([hooked.to_single_token(" Paris")])) == [" Paris"]
    with pytest.raises(ValueError, match=r"^string: ' Parisienne' is 2 tokens \("):
        hooked.to_single_token(" Parisienne")
    assert torch.equal(hooked.tokens_to_residual_directions(" Paris"), hooked.W_U[:, hooked.to_single_token(" Paris")])
