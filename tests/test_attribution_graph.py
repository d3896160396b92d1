"""Attribution graphs (vlens.attribution_graph) against circuit-tracer's own `attribute`, `prune_graph` and
`compute_graph_scores` on TransformerLens models with the same weights and the same per-layer transcoders: every
edge, the active features and their values, the logit nodes, the feature nodes kept under max_feature_nodes."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import transformer_lens_gemma2, transformer_lens_gpt2, transformer_lens_llama

from vlens import SAE, HookedLM, SamplingParams
from vlens.attribution_graph import attribute, graph_scores, prune_graph, to_circuit_tracer
from vlens.feature_intervention import feature_clamps, feature_intervention, feature_intervention_generate

PROMPT = torch.tensor([0, 17, 99, 230, 3, 41, 7, 250, 12, 33])  # (0: the stand-in tokenizer's special token)


class SpecialFirst:
    """What circuit-tracer asks of a tokenizer for token-id prompts: its special ids (0 here) and decode."""

    all_special_ids = [0]
    bos_token_id = pad_token_id = eos_token_id = 0
    padding_side = "right"
    vocab_size = 300

    def decode(self, ids):
        return " ".join(map(str, ids if isinstance(ids, list) else [ids]))


def circuit_tracer():
    import huggingface_hub.constants

    # (circuit-tracer 0.5 imports a constant huggingface_hub 1.x no longer has; nothing here downloads)
    huggingface_hub.constants.HF_HUB_ENABLE_HF_TRANSFER = False
    import circuit_tracer

    return circuit_tracer


def transcoders(d_model: int, d_sae: int, layers: int, skip: bool, jumprelu: bool, seed: int = 0,
                hook_out: str = "hook_mlp_out"):  # fmt: skip
    """circuit-tracer's SingleLayerTranscoders with random weights, and the same as vlens SAEs (writing each
    layer's `hook_out`)."""
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder

    g = torch.Generator().manual_seed(seed)
    theirs, ours = {}, []
    for layer in range(layers):
        threshold = torch.rand(d_sae, generator=g) * 0.3
        act = JumpReLU(threshold, 0.1) if jumprelu else torch.nn.ReLU()
        tc = SingleLayerTranscoder(d_model, d_sae, act, layer, skip_connection=skip, device=torch.device("cpu"),
                                   dtype=torch.float32)  # fmt: skip
        with torch.no_grad():
            for name, p in tc.named_parameters():
                if name != "activation_function.threshold":
                    p.copy_(torch.randn(p.shape, generator=g) * (0.05 if name == "W_skip" else 0.3))
        theirs[layer] = tc
        ours.append(SAE(
            W_enc=tc.W_enc.detach().T.clone(), b_enc=tc.b_enc.detach().clone(), W_dec=tc.W_dec.detach().clone(),
            b_dec=tc.b_dec.detach().clone(), W_skip=None if tc.W_skip is None else tc.W_skip.detach().clone(),
            threshold=threshold if jumprelu else None, architecture="jumprelu" if jumprelu else "standard",
            apply_b_dec_to_input=False, hook=f"blocks.{layer}.ln2.hook_out", hook_out=f"blocks.{layer}.{hook_out}",
        ))  # fmt: skip
    return theirs, ours


def cross_layer_transcoder(jumprelu: bool, skip: bool, seed: int = 0):
    """circuit-tracer's CrossLayerTranscoder over the tiny models' 3 layers, random weights (thresholds >= 0)."""
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder

    clt = CrossLayerTranscoder(3, 32, 64, "jump_relu" if jumprelu else "relu", skip_connection=skip, lazy_decoder=False,
                               feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out",
                               device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in clt.named_parameters():
            scale = 0.3 if "threshold" in name else 0.05 if name == "W_skip" else 0.25
            p.copy_((torch.rand if "threshold" in name else torch.randn)(p.shape, generator=g) * scale)
    return clt


def saelens_transcoder(tc: SAE, layer: int):
    """The same transcoder as SAELens's Transcoder object, reading its blocks.L.mlp.hook_in."""
    from sae_lens import Transcoder, TranscoderConfig
    from sae_lens.saes.sae import SAEMetadata

    metadata = SAEMetadata(hook_name=f"blocks.{layer}.mlp.hook_in", hook_name_out=f"blocks.{layer}.hook_mlp_out")
    theirs = Transcoder(TranscoderConfig(d_in=tc.d_in, d_sae=tc.d_sae, d_out=tc.d_out, apply_b_dec_to_input=False,
                                         metadata=metadata))  # fmt: skip
    theirs.load_state_dict({"W_enc": tc.W_enc, "b_enc": tc.b_enc, "W_dec": tc.W_dec, "b_dec": tc.b_dec})
    return theirs


def replacement_model(reference, theirs, writes: str = "mlp.hook_out"):
    """circuit-tracer's TransformerLens replacement model of `reference` with per-layer transcoders `theirs` (by
    layer) or a cross-layer transcoder."""
    circuit_tracer()
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from circuit_tracer.transcoder import TranscoderSet

    model = TransformerLensReplacementModel(reference.cfg)
    model.load_state_dict(reference.state_dict(), strict=False)
    if isinstance(theirs, dict):
        theirs = TranscoderSet(theirs, feature_input_hook="mlp.hook_in", feature_output_hook=writes)
    model._configure_replacement_model(theirs)
    model.tokenizer = SpecialFirst()
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    gpt2, gpt2_ref = transformer_lens_gpt2(root / "gpt2", initializer_range=0.1)
    llama, llama_ref = transformer_lens_llama(root / "llama")
    gemma2, gemma2_ref = transformer_lens_gemma2(root / "gemma2")
    return {"gpt2": (HookedLM(gpt2, dtype="float32", device="cpu"), gpt2_ref),
            "llama": (HookedLM(llama, dtype="float32", device="cpu"), llama_ref),
            "gemma2": (HookedLM(gemma2, dtype="float32", device="cpu"), gemma2_ref)}  # fmt: skip


EDGE_CASES = [("gpt2", False, False, "mlp.hook_out"), ("gpt2", True, True, "mlp.hook_out"),
              ("llama", True, False, "mlp.hook_out"), ("gemma2", False, True, "hook_mlp_out"),
              ("gemma2", True, False, "mlp.hook_out")]  # fmt: skip


@pytest.mark.parametrize(("family", "skip", "jumprelu", "writes"), EDGE_CASES)
def test_every_edge_equals_circuit_tracer_s(models, family, skip, jumprelu, writes):
    """Gemma 2 (post-norms, soft-caps): transcoders that write hook_mlp_out, after the MLP's post-norm, as Gemma
    Scope's do, or mlp.hook_out, the MLP's output before it (circuit-tracer's replaced MLP); the post-norms' scales
    are frozen with the others. (Elsewhere the two are one hook, vlens's hook_mlp_out.)"""
    hooked, reference = models[family]
    theirs, ours = transcoders(64, 48, 3, skip, jumprelu, hook_out=writes if family == "gemma2" else "hook_mlp_out")
    want = circuit_tracer().attribute(PROMPT, replacement_model(reference, theirs, writes), batch_size=32)
    got = attribute(hooked, PROMPT, ours, batch_size=32)
    assert torch.equal(got.active_features, want.active_features.long()) and len(got.active_features) > 100
    assert rel_err(got.activation_values, want.activation_values) <= 1e-5
    assert got.logit_tokens.tolist() == [t.vocab_idx for t in want.logit_targets]
    assert rel_err(got.logit_probabilities, want.logit_probabilities) <= 1e-5
    assert got.adjacency_matrix.shape == want.adjacency_matrix.shape
    assert rel_err(got.adjacency_matrix, want.adjacency_matrix) <= 1e-4
    assert (got.adjacency_matrix[got.n_features :] != 0).sum() == (want.adjacency_matrix[got.n_features :] != 0).sum()
    if skip:  # circuit-tracer's own transcoders, as its TranscoderSet holds them, give the same graph
        their_set = replacement_model(reference, theirs, writes).transcoders
        same = attribute(hooked, PROMPT, their_set, batch_size=32)
        assert rel_err(same.adjacency_matrix, got.adjacency_matrix) <= 1e-6


@pytest.mark.parametrize(("family", "jumprelu", "skip"), [("gpt2", False, True), ("llama", True, False)])
def test_cross_layer_transcoders_edges_equal_circuit_tracer_s(models, family, jumprelu, skip, tmp_path):
    """A cross-layer transcoder: each feature writes to its layer's MLP output and every later one's."""
    hooked, reference = models[family]
    clt = cross_layer_transcoder(jumprelu, skip)
    want = circuit_tracer().attribute(PROMPT, replacement_model(reference, clt), batch_size=32)
    got = attribute(hooked, PROMPT, clt, batch_size=32)
    assert torch.equal(got.active_features, want.active_features.long()) and len(got.active_features) > 50
    assert rel_err(got.activation_values, want.activation_values) <= 1e-5
    assert got.logit_tokens.tolist() == [t.vocab_idx for t in want.logit_targets]
    assert rel_err(got.adjacency_matrix, want.adjacency_matrix) <= 1e-4
    # its writes to later layers count: the same features writing to their own layer alone make another graph
    alone = [SAE(W_enc=clt.W_enc[layer].detach().T.contiguous(), b_enc=clt.b_enc[layer].detach(),
                 W_dec=clt.W_dec[layer][:, 0].detach().contiguous(), b_dec=clt.b_dec[layer].detach(),
                 W_skip=None if clt.W_skip is None else clt.W_skip[layer].detach().T.contiguous(),
                 threshold=clt.activation_function.threshold[layer, 0].detach() if jumprelu else None,
                 architecture="jumprelu" if jumprelu else "standard", apply_b_dec_to_input=False,
                 hook=f"blocks.{layer}.ln2.hook_out", hook_out=f"blocks.{layer}.hook_mlp_out")
             for layer in range(3)]  # fmt: skip
    own_layer = attribute(hooked, PROMPT, alone, batch_size=32)
    assert torch.equal(own_layer.active_features, got.active_features)
    assert rel_err(own_layer.adjacency_matrix, got.adjacency_matrix) > 1e-2
    if skip:  # (circuit-tracer's to_safetensors does not save W_skip)
        return
    # saved as circuit-tracer saves it and loaded with its decoders left on disk: the same graph
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

    clt.to_safetensors(str(tmp_path / "clt"))
    lazy = load_clt(str(tmp_path / "clt"), "mlp.hook_in", "mlp.hook_out", device=torch.device("cpu"),
                    dtype=torch.float32, lazy_decoder=True)  # fmt: skip
    assert lazy.W_dec is None
    assert rel_err(attribute(hooked, PROMPT, lazy, batch_size=32).adjacency_matrix, got.adjacency_matrix) <= 1e-6


def test_chosen_logit_targets_equal_circuit_tracer_s(models):
    """attribution_targets: token ids (their probabilities whatever they are), and a custom target (a logit
    difference: the difference of two unembedding columns, weight 1)."""
    hooked, reference = models["gpt2"]
    theirs, ours = transcoders(64, 48, 3, skip=False, jumprelu=False)
    model = replacement_model(reference, theirs)
    ids = torch.tensor([7, 250, 33])
    W_U = hooked.W_U
    custom = [("250 - 7", 1.0, W_U[:, 250] - W_U[:, 7]), ("33", 0.5, W_U[:, 33] - W_U.mean(-1))]
    for targets in (ids, custom):
        want = circuit_tracer().attribute(PROMPT, model, attribution_targets=targets, batch_size=32)
        got = attribute(hooked, PROMPT, ours, attribution_targets=targets, batch_size=32)
        assert got.logit_tokens.tolist() == [t.vocab_idx for t in want.logit_targets]
        assert got.logit_names[0] == want.logit_targets[0].token_str or targets is ids
        assert rel_err(got.logit_probabilities, want.logit_probabilities) <= 1e-6
        assert rel_err(got.adjacency_matrix, want.adjacency_matrix) <= 1e-4
    # the custom difference's row is the difference of the two tokens' rows (their means cancel)
    by_ids = attribute(hooked, PROMPT, ours, attribution_targets=[250, 7], batch_size=32)
    rows = by_ids.adjacency_matrix[-2:]
    assert rel_err(got.adjacency_matrix[-2], rows[0] - rows[1]) <= 1e-5
    with pytest.raises(ValueError, match=r"^attribution_targets: \[300\] is not None, token ids in 0\.\.299"):
        attribute(hooked, PROMPT, ours, attribution_targets=[300])
    with pytest.raises(ValueError, match=r"^attribution_targets\[0\]: a custom target is \(name, weight, vector"):
        attribute(hooked, PROMPT, ours, attribution_targets=[("x", 1.0, torch.zeros(3))])


def test_kept_feature_nodes_pruning_and_scores_equal_circuit_tracer_s(models):
    """max_feature_nodes keeps the features circuit-tracer's ranking keeps (by influence, in rounds); pruning and the
    replacement / completeness scores of the same graph agree."""
    from circuit_tracer.graph import compute_graph_scores
    from circuit_tracer.graph import prune_graph as their_prune

    hooked, reference = models["gpt2"]
    theirs, ours = transcoders(64, 48, 3, skip=True, jumprelu=False, seed=3)
    model = replacement_model(reference, theirs)
    want = circuit_tracer().attribute(PROMPT, model, batch_size=16, max_feature_nodes=100)
    got = attribute(hooked, PROMPT, ours, batch_size=16, max_feature_nodes=100)
    assert torch.equal(got.selected_features, want.selected_features) and got.n_features == 100
    assert rel_err(got.adjacency_matrix, want.adjacency_matrix) <= 1e-4
    full = circuit_tracer().attribute(PROMPT, model, batch_size=64)
    graph = attribute(hooked, PROMPT, ours, batch_size=64)
    for thresholds in ((0.8, 0.98), (0.5, 0.9)):
        nodes, edges, cumulative = prune_graph(graph, *thresholds)
        ref = their_prune(full, *thresholds)
        assert torch.equal(nodes, ref.node_mask) and torch.equal(edges, ref.edge_mask)
        assert rel_err(cumulative, ref.cumulative_scores) <= 1e-5 and 0 < nodes.sum() < len(nodes)
    assert graph_scores(graph) == pytest.approx(compute_graph_scores(full), rel=1e-5)


def test_the_graph_s_layout_and_what_is_refused(models):
    """Node helpers index the adjacency as circuit-tracer lays it out; position 0 has no feature or error nodes; bad
    transcoder sets, prompts and options are refused by name."""
    hooked, _ = models["gpt2"]
    _, ours = transcoders(64, 48, 3, skip=False, jumprelu=False)
    graph = attribute(hooked, PROMPT, ours, max_n_logits=3, desired_logit_prob=1.0)
    n = graph.n_features + 4 * graph.n_pos + 3
    assert graph.adjacency_matrix.shape == (n, n) and graph.logit_node(2) == n - 1 and graph.token_node(0) == n - 3 - 10
    assert (graph.active_features[:, 1] > 0).all() and not graph.adjacency_matrix[:, graph.error_node(1, 0)].any()
    assert graph.adjacency_matrix[graph.logit_node(0), graph.token_node(9)] != 0  # (the last token reaches the logit)
    assert not graph.adjacency_matrix[: graph.n_features, graph.token_node(9)][graph.active_features[:, 1] < 9].any()
    saelens = [saelens_transcoder(tc, layer) for layer, tc in enumerate(ours)]  # (reading SAELens's mlp.hook_in)
    again = attribute(hooked, PROMPT, saelens, max_n_logits=3, desired_logit_prob=1.0)
    assert rel_err(again.adjacency_matrix, graph.adjacency_matrix) <= 1e-6  # (their weights' layout: not bit for bit)
    with pytest.raises(ValueError, match=r"^transcoders: 2 given; an attribution graph needs one per layer, 3"):
        attribute(hooked, PROMPT, ours[:2])
    sae = SAE(ours[1].W_enc, ours[1].b_enc, ours[1].W_dec, ours[1].b_dec, hook="blocks.1.hook_resid_post")
    with pytest.raises(ValueError, match=r"^transcoders\[1\]: an SAE \(it writes where it reads\)"):
        attribute(hooked, PROMPT, [ours[0], sae, ours[2]])
    w = ours[2]
    late = SAE(w.W_enc, w.b_enc, w.W_dec, w.b_dec, apply_b_dec_to_input=False, hook="blocks.2.mlp.hook_post",
               hook_out="blocks.2.hook_mlp_out")  # fmt: skip
    with pytest.raises(ValueError, match=r"^transcoders\[2\]: reads 'blocks\.2\.mlp\.hook_post'; layer 2's must read"):
        attribute(hooked, PROMPT, [*ours[:2], late])
    from circuit_tracer.transcoder.activation_functions import JumpReLU, TopK

    tc = transcoders(64, 48, 1, skip=False, jumprelu=True)[0][0]
    tc.activation_function = JumpReLU(torch.full((48,), -0.1))
    with pytest.raises(ValueError, match=r"has negative JumpReLU thresholds, which vlens's JumpReLU does not take"):
        SAE.from_circuit_tracer(tc, "blocks.0.ln2.hook_out", "blocks.0.hook_mlp_out")
    tc.activation_function = TopK(4)
    with pytest.raises(ValueError, match=r"activation TopK is not supported; supported: ReLU, JumpReLU"):
        SAE.from_circuit_tracer(tc, "blocks.0.ln2.hook_out", "blocks.0.hook_mlp_out")
    with pytest.raises(ValueError, match=r"^prompt: token ids in 0\.\.299"):
        attribute(hooked, [5, 300], ours)
    with pytest.raises(ValueError, match=r"^max_feature_nodes: 0 is not an int >= 1 \(or None\)"):
        attribute(hooked, PROMPT, ours, max_feature_nodes=0)
    with pytest.raises(ValueError, match=r"^desired_logit_prob: 0 is not in \(0, 1\]"):
        attribute(hooked, PROMPT, ours, desired_logit_prob=0)
    with pytest.raises(ValueError, match=r"^node_threshold: 1\.5 is not in \[0, 1\]"):
        prune_graph(graph, node_threshold=1.5)


def test_a_smollm2_graph_draws_in_circuit_tracer_s_viewer(smol_path, tmp_path):
    """On SmolLM2 (random sparse transcoders: none trained exist here), the graph converts to circuit-tracer's Graph,
    whose create_graph_files writes the viewer's JSON: the pruned graph's nodes and edges, with vlens's weights."""
    import json

    from circuit_tracer.graph import Graph as TracerGraph
    from circuit_tracer.utils.create_graph_files import create_graph_files

    model = HookedLM(str(smol_path), dtype="float32")
    text = "The capital of the state containing Dallas is"
    tokens = model.to_tokens(text, prepend_bos=True)[0]
    _, cache = model.run_with_cache(tokens[None], names_filter=lambda name: name.endswith("ln2.hook_out"))
    g, d, ours = torch.Generator().manual_seed(0), model.cfg.hidden_size, []
    for layer in range(model.cfg.num_layers):
        W_enc = torch.randn(d, 256, generator=g) / d**0.5
        cut = (cache[f"blocks.{layer}.ln2.hook_out"][0, 1:] @ W_enc).flatten().quantile(0.97)
        ours.append(SAE(W_enc, -cut.expand(256).clone(), torch.randn(256, d, generator=g) * 0.02, torch.zeros(d),
                        apply_b_dec_to_input=False, hook=f"blocks.{layer}.ln2.hook_out",
                        hook_out=f"blocks.{layer}.hook_mlp_out"))  # fmt: skip
    graph = attribute(model, text, ours, max_feature_nodes=48, batch_size=48)
    assert torch.equal(graph.input_tokens, tokens)  # (a special token put first: SmolLM2's texts have none)
    theirs = to_circuit_tracer(graph, model, scan="random-smollm2")
    theirs.to_pt(tmp_path / "graph.pt")
    again = TracerGraph.from_pt(tmp_path / "graph.pt")
    assert torch.equal(again.adjacency_matrix, graph.adjacency_matrix) and again.cfg.n_layers == 30
    create_graph_files(again, "dallas", tmp_path / "viewer", node_threshold=0.8, edge_threshold=0.98)
    drawn = json.loads((tmp_path / "viewer" / "dallas.json").read_text())
    assert drawn["metadata"]["prompt_tokens"][0] == model.tokenizer.decode([int(tokens[0])])
    pruned = prune_graph(graph)
    kept = pruned.edge_mask.nonzero().tolist()
    weights = sorted(graph.adjacency_matrix[t, s].item() for t, s in kept)
    assert sorted(link["weight"] for link in drawn["links"]) == weights
    kinds = [node["feature_type"] for node in drawn["nodes"]]
    assert kinds.count("embedding") == len(tokens) and kinds.count("logit") == len(graph.logit_tokens)
    connected = {node for edge in kept for node in edge}  # (the viewer draws the nodes some kept edge touches)
    assert kinds.count("cross layer transcoder") == sum(node < graph.n_features for node in connected)
    errors = range(graph.error_node(0, 0), graph.token_node(0))
    assert kinds.count("mlp reconstruction error") == sum(node in errors for node in connected) > 0
    # logit nodes named by their texts (one token each)
    chosen = attribute(model, text, ours, attribution_targets=[" Austin", " Texas"], max_feature_nodes=8)
    assert chosen.logit_names == [" Austin", " Texas"]
    assert chosen.logit_tokens.tolist() == [model.to_single_token(" Austin"), model.to_single_token(" Texas")]
    with pytest.raises(ValueError, match=r"^attribution_targets: ' Austin, Texas' is \d tokens"):
        attribute(model, text, ours, attribution_targets=[" Austin, Texas"])


INTERVENTION_CASES = [("gpt2", "per-layer", True), ("gpt2", "per-layer", False), ("llama", "cross-layer", True),
                      ("gemma2", "per-layer", True)]  # fmt: skip


@pytest.mark.parametrize(("family", "kind", "freeze"), INTERVENTION_CASES)
def test_feature_interventions_equal_circuit_tracer_s(models, family, kind, freeze):
    """Features set (one off, one up, at two layers and positions; one at position 0): the logits and every layer's
    features on the intervened run equal circuit-tracer's feature_intervention's, with attention frozen or not."""
    hooked, reference = models[family]
    if kind == "cross-layer":
        theirs = ours = cross_layer_transcoder(jumprelu=False, skip=True)
    else:
        per_layer, ours = transcoders(64, 48, 3, skip=True, jumprelu=False)
    writes = "hook_mlp_out" if family == "gemma2" else "mlp.hook_out"
    model = replacement_model(reference, theirs if kind == "cross-layer" else per_layer, writes)
    graph = attribute(hooked, PROMPT, ours, batch_size=64)
    (l1, p1, f1), (l2, p2, f2) = graph.active_features[0].tolist(), graph.active_features[-1].tolist()
    interventions = [(l1, p1, f1, 0.0), (l2, p2, f2, 3.0 * graph.activation_values[-1].item()), (1, 0, 5, 2.0)]
    with torch.no_grad():
        want_logits, want_acts = model.feature_intervention(PROMPT, interventions, freeze_attention=freeze)
    logits, acts = feature_intervention(hooked, PROMPT, ours, interventions, freeze_attention=freeze)
    assert rel_err(logits, want_logits[0]) <= 1e-5 and rel_err(acts, want_acts) <= 1e-5
    plain, plain_acts = feature_intervention(hooked, PROMPT, ours, [])
    # (a feature set at layer 0 changes what later transcoders read; the one set is reported as its transcoder reads it)
    assert rel_err(logits, plain) > 1e-3 and rel_err(acts[l2], plain_acts[l2]) > 1e-3 and acts[l1, p1, f1] > 0
    assert rel_err(plain, hooked(PROMPT[None])[0]) <= 1e-6  # (no interventions: the model's own forward)
    with pytest.raises(ValueError, match=r"^interventions\[0\]: \(3, 0, 0, 1\.0\) is not \(layer in 0\.\.2"):
        feature_intervention(hooked, PROMPT, ours, [(3, 0, 0, 1.0)])


GENERATE_CASES = [("gpt2", "per-layer", None), ("gpt2", "per-layer", range(3)), ("llama", "cross-layer", None),
                  ("gemma2", "per-layer", range(1, 3))]  # fmt: skip


@pytest.mark.parametrize(("family", "kind", "layers"), GENERATE_CASES)
def test_feature_intervention_generate_equals_circuit_tracer_s(models, family, kind, layers):
    """Features set on the prompt (attention frozen, or constrained layers, on its forward), one open-ended from a
    prompt position on (slice(p, None): every generated token's too): the tokens, each step's logits and the features
    of every position fed equal circuit-tracer's feature_intervention_generate's (over TransformerLens's KV cache)."""
    hooked, reference = models[family]
    if kind == "cross-layer":
        theirs = ours = cross_layer_transcoder(jumprelu=False, skip=True, seed=4)
    else:
        theirs, ours = transcoders(64, 48, 3, skip=True, jumprelu=False, seed=4)
    model = replacement_model(reference, theirs, "hook_mlp_out" if family == "gemma2" else "mlp.hook_out")
    interventions = [(0, 3, 5, 0.0), (1, slice(6, None), 7, 4.0), (2, 0, 3, 2.0), (2, slice(2, 5), 9, 1.5)]
    options = {"max_new_tokens": 5, "do_sample": False, "stop_at_eos": False, "verbose": False}
    with torch.no_grad():
        want = model.feature_intervention_generate(PROMPT[None], interventions, constrained_layers=layers, **options)
    tokens, logits, acts = feature_intervention_generate(hooked, PROMPT, ours, interventions, constrained_layers=layers,
                                                         **options)  # fmt: skip
    assert tokens.tolist() == want[0].tolist() and logits.shape == (5, 300) and acts.shape[:2] == (3, 14)
    assert rel_err(logits, want[1]) <= 1e-5 and rel_err(acts, want[2]) <= 1e-5
    prompt_only = [iv for iv in interventions if not isinstance(iv[1], slice) or iv[1].stop is not None]
    _, plain_logits, _ = feature_intervention_generate(hooked, PROMPT, ours, prompt_only, constrained_layers=layers,
                                                       **options)  # fmt: skip
    assert rel_err(logits[0], plain_logits[0]) > 1e-4 and rel_err(logits[1:], plain_logits[1:]) > 1e-4
    with pytest.raises(ValueError, match=r"^use_past_kv_cache: feature_intervention_generate runs each new token"):
        feature_intervention_generate(hooked, PROMPT, ours, interventions, use_past_kv_cache=False)


@pytest.mark.parametrize(("family", "kind"), [("gpt2", "per-layer"), ("llama", "cross-layer")])
def test_feature_clamps_in_the_engine_equal_feature_intervention_generate(models, family, kind):
    """feature_clamps: the engine's per-request Clamps (a cross-layer feature's at every layer it writes to) set
    features at every position from 1 on, beside a plain request in the batch: the greedy tokens and each step's
    log-probabilities equal feature_intervention_generate's with the features set open-ended, attention free."""
    hooked, _ = models[family]
    if kind == "cross-layer":
        ours = cross_layer_transcoder(jumprelu=True, skip=True, seed=5)
    else:
        _, ours = transcoders(64, 48, 3, skip=True, jumprelu=True, seed=5)
    sets = [(0, 3, 4.0), (1, 7, 0.0), (2, 11, -2.5)]
    options = {"max_new_tokens": 5, "do_sample": False, "stop_at_eos": False, "verbose": False}
    open_ended = [(layer, slice(1, None), feature, value) for layer, feature, value in sets]
    tokens, logits, _ = feature_intervention_generate(hooked, PROMPT, ours, open_ended, freeze_attention=False, **options)
    clamps = feature_clamps(hooked, ours, sets, positions=slice(1, None))
    assert len(clamps) == (3 + 2 + 1 if kind == "cross-layer" else 3)
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    out, plain = hooked.llm.generate([PROMPT.tolist()] * 2, [SamplingParams(**greedy, interventions=clamps),
                                                            SamplingParams(**greedy)], use_tqdm=False)  # fmt: skip
    assert out.outputs[0].token_ids == tokens[0, len(PROMPT) :].tolist()
    want = logits.log_softmax(-1)
    for step, top in enumerate(out.outputs[0].logprobs):
        for token, logprob in top.items():
            assert abs(logprob.logprob - want[step, token].item()) <= 1e-5, (step, token)
    [alone] = hooked.llm.generate([PROMPT.tolist()], SamplingParams(**greedy), use_tqdm=False)
    assert plain.outputs[0].token_ids == alone.outputs[0].token_ids != out.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"^interventions\[0\]: \(3, 0, 1\.0\) is not \(layer in 0\.\.2"):
        feature_clamps(hooked, ours, [(3, 0, 1.0)])


@pytest.mark.parametrize(("kind", "layers"), [("per-layer", range(3)), ("per-layer", range(1, 3)),
                                              ("cross-layer", range(3))])  # fmt: skip
def test_constrained_interventions_equal_circuit_tracer_s_and_the_graph_s_edges(models, kind, layers):
    """constrained_layers: circuit-tracer's logits and features; and with every layer constrained, a feature turned
    off moves each logit node's reading (its logit minus the mean logit) by minus its edge to it: the graph's
    direct effects, computed by a forward instead of a gradient."""
    hooked, reference = models["gpt2"]
    if kind == "cross-layer":
        theirs = ours = cross_layer_transcoder(jumprelu=False, skip=True, seed=2)
    else:
        per_layer, ours = transcoders(64, 48, 3, skip=True, jumprelu=False, seed=2)
        theirs = per_layer
    model = replacement_model(reference, theirs)
    graph = attribute(hooked, PROMPT, ours, max_n_logits=3, desired_logit_prob=1.0, batch_size=64)
    (layer, position, feature), node = graph.active_features[5].tolist(), 5
    off = [(layer, position, feature, 0.0)]
    with torch.no_grad():
        want_logits, want_acts = model.feature_intervention(PROMPT, off, constrained_layers=layers)
    logits, acts = feature_intervention(hooked, PROMPT, ours, off, constrained_layers=layers)
    assert rel_err(logits, want_logits[0]) <= 1e-5 and rel_err(acts, want_acts) <= 1e-5
    if layers == range(3):
        plain = hooked(PROMPT[None])[0, -1]
        reading = lambda row: row[graph.logit_tokens] - row.mean()  # noqa: E731
        moved = reading(logits[-1]) - reading(plain)
        edges = graph.adjacency_matrix[[graph.logit_node(i) for i in range(3)], node]
        assert rel_err(moved, -edges) <= 1e-4 and edges.abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"^constrained_layers: range\(0, 4\) is not layers in 0\.\.2"):
        feature_intervention(hooked, PROMPT, ours, off, constrained_layers=range(4))
