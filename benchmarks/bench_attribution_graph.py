"""Attribution graphs: vlens.attribution_graph.attribute (HookedLM's forward with the replacement model's freezes
as hooks) against circuit-tracer's own `attribute` (its TransformerLens replacement model) in one run, on the same
weights, transcoders and prompt; prints each one's time, their ratio and how far their edges differ.

    .venv/bin/python benchmarks/bench_attribution_graph.py [--repeats 2] [--max-feature-nodes 256] [--batch-size 32]

SmolLM2-135M in float32 on this CPU, for circuit-tracer converted to TransformerLens's Llama (its weights unfolded,
as circuit-tracer loads models). No trained transcoders for SmolLM2 exist here, so each layer gets a ReLU transcoder
with random weights reading the MLP's input and writing its output, its encoder bias set so that about 16 of its
1024 features fire per position on the prompt: the work per feature node is what trained ones would cost.
"""

from __future__ import annotations

import argparse

import torch
from bench_generate import best_alternating
from transformers import AutoModelForCausalLM

from vlens import SAE, HookedLM
from vlens.attribution_graph import attribute
from vlens.loader import resolve_model_path

PROMPT = "The capital of the state containing Dallas is"
D_SAE, FIRING = 1024, 16


def transcoders(model: HookedLM, tokens: torch.Tensor) -> list[SAE]:
    """Random ReLU transcoders, each firing about FIRING features per position on `tokens`."""
    n, d = model.cfg.num_layers, model.cfg.hidden_size
    _, cache = model.run_with_cache(tokens[None], names_filter=[f"blocks.{i}.ln2.hook_out" for i in range(n)])
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in range(n):
        W_enc = torch.randn(d, D_SAE, generator=g) / d**0.5
        pre = cache[f"blocks.{layer}.ln2.hook_out"][0, 1:] @ W_enc
        b_enc = -pre.flatten().quantile(1 - FIRING / D_SAE).expand(D_SAE).clone()
        out.append(SAE(W_enc, b_enc, torch.randn(D_SAE, d, generator=g) * 0.02, torch.zeros(d),
                       apply_b_dec_to_input=False, hook=f"blocks.{layer}.ln2.hook_out",
                       hook_out=f"blocks.{layer}.hook_mlp_out"))  # fmt: skip
    return out


def circuit_tracer_model(path: str, ours: list[SAE], tokenizer):
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_ENABLE_HF_TRANSFER = False  # (a constant circuit-tracer 0.5 imports)
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from circuit_tracer.transcoder import TranscoderSet
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.num_hidden_layers, d_model=c.hidden_size, d_head=c.head_dim, n_heads=c.num_attention_heads,
        n_key_value_heads=c.num_key_value_heads, d_mlp=c.intermediate_size, d_vocab=c.vocab_size, n_ctx=2048,
        act_fn="silu", normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary",
        rotary_dim=c.head_dim, rotary_base=c.rope_parameters["rope_theta"], final_rms=True, gated_mlp=True,
        original_architecture="LlamaForCausalLM", dtype=torch.float32,
    )  # fmt: skip
    model = TransformerLensReplacementModel(cfg)
    model.load_state_dict(convert_llama_weights(hf, cfg), strict=False)
    theirs = {}
    for layer, tc in enumerate(ours):
        t = SingleLayerTranscoder(tc.d_in, tc.d_sae, torch.nn.ReLU(), layer, device=torch.device("cpu"),
                                  dtype=torch.float32)  # fmt: skip
        with torch.no_grad():
            t.W_enc.copy_(tc.W_enc.T), t.b_enc.copy_(tc.b_enc), t.W_dec.copy_(tc.W_dec), t.b_dec.copy_(tc.b_dec)
        theirs[layer] = t
    model._configure_replacement_model(TranscoderSet(theirs, feature_input_hook="mlp.hook_in",
                                                     feature_output_hook="mlp.hook_out"))  # fmt: skip
    model.tokenizer = tokenizer
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-feature-nodes", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    path = str(resolve_model_path(None))
    hooked = HookedLM(path, dtype="float32", device="cpu")
    tokens = torch.tensor([hooked.tokenizer.bos_token_id, *hooked.tokenizer(PROMPT)["input_ids"]])
    ours = transcoders(hooked, tokens)
    theirs = circuit_tracer_model(path, ours, hooked.tokenizer)
    options = {"max_feature_nodes": args.max_feature_nodes, "batch_size": args.batch_size}
    import circuit_tracer

    graphs = {}

    def ours_once() -> None:
        graphs["vlens"] = attribute(hooked, tokens, ours, **options)

    def theirs_once() -> None:
        graphs["circuit-tracer"] = circuit_tracer.attribute(tokens, theirs, **options)

    times = dict(zip(("vlens", "circuit-tracer"), best_alternating([ours_once, theirs_once], args.repeats)))
    got, want = graphs["vlens"], graphs["circuit-tracer"]
    a, b = got.adjacency_matrix.double(), want.adjacency_matrix.double()
    print(f"SmolLM2-135M float32, CPU; {len(tokens)} tokens, {len(got.active_features)} active features, "
          f"{got.n_features} feature nodes, {len(got.logit_tokens)} logits; batch_size {args.batch_size}")  # fmt: skip
    for name, seconds in times.items():
        print(f"  {name:15s} {seconds:7.2f} s")
    print(f"  vlens / circuit-tracer: {times['vlens'] / times['circuit-tracer']:.2f}x")
    same = torch.equal(got.selected_features, want.selected_features)
    print(f"  same feature nodes: {same}; edges' relative difference {((a - b).norm() / b.norm()).item():.1e}")


if __name__ == "__main__":
    main()
