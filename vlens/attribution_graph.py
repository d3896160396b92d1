"""Attribution graphs (Ameisen et al., 2025, "Circuit Tracing"; the circuit-tracer library's `attribute`): the direct,
linear effect of every active transcoder feature, every transcoder error and every input token on every active
feature and on the likeliest next-token logits of one prompt, in the prompt's local replacement model.

The replacement model is the model with its MLPs read through transcoders (one per layer, or a cross-layer one:
vlens.replacement) and, for this prompt, its attention patterns and every norm's divisor frozen at their values on
the prompt: then the residual stream is linear from each writer to each reader. A feature's activation a_s writes
a_s W_dec[s] into the MLP outputs it decodes to; what the transcoders miss there is an error node (the MLP's
output minus what they write, skip connection included); the tokens write their embeddings. A target reads the
stream: a feature through its encoder row at its transcoder's input (its pre-activation), a logit through its
unembedding column minus the mean column, after the final norm. The edge s -> t is the gradient of the target's
reading with respect to the source's write, dotted with the write — one backward pass per target, many targets at
once over copies of the prompt (`batch_size`). Position 0 (a special token, put first where a text lacks one) has
no feature or error nodes, as in circuit-tracer: its features are zeroed and its MLP output is part of no node.

`tests/test_attribution_graph.py` checks every edge against circuit-tracer's own `attribute` (and `prune_graph`,
`compute_graph_scores`) on the same weights and transcoders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vlens.capture.names import FINAL_NORM, layer_norms
from vlens.replacement import CrossLayer, PerLayer, check_frozen_attention, replacement

if TYPE_CHECKING:
    from vlens.hooked import HookedLM

ZERO_POSITIONS = 1  # positions from 0 without feature or error nodes


@dataclass
class Graph:
    """An attribution graph. Nodes, in order: the selected features (`active_features[selected_features]`), the
    error nodes (layer by layer, position by position), the tokens (by position), the logits. `adjacency_matrix`
    [nodes, nodes]: row t, column s holds the direct effect of s on t (rows of errors and tokens are 0)."""

    input_tokens: torch.Tensor  # [n_pos]
    active_features: torch.Tensor  # [n_active, 3]: layer, position, feature
    activation_values: torch.Tensor  # [n_active]
    selected_features: torch.Tensor  # indices into active_features of the feature nodes, ascending
    adjacency_matrix: torch.Tensor
    logit_tokens: torch.Tensor  # [n_logits] ids, the likeliest first (a custom target: vocab_size + its index)
    logit_probabilities: torch.Tensor  # [n_logits]: their weights in the influence on the logits
    n_layers: int
    logit_names: list[str]  # each logit node's token as text (a custom target: its name)

    @property
    def n_pos(self) -> int:
        return len(self.input_tokens)

    @property
    def n_features(self) -> int:
        return len(self.selected_features)

    def error_node(self, layer: int, position: int) -> int:
        return self.n_features + layer * self.n_pos + position

    def token_node(self, position: int) -> int:
        return self.n_features + self.n_layers * self.n_pos + position

    def logit_node(self, i: int) -> int:
        return self.n_features + (self.n_layers + 1) * self.n_pos + i


def attribute(
    model: HookedLM, prompt: str | Sequence[int] | torch.Tensor, transcoders: Any, *, max_n_logits: int = 10,
    desired_logit_prob: float = 0.95, batch_size: int = 256, max_feature_nodes: int | None = None,
    attribution_targets: Any = None,
) -> Graph:  # fmt: skip
    """The attribution graph of `prompt` (a text, or token ids) through `transcoders`: one per layer, in layer order
    (vlens SAEs with hook_out, SAELens's transcoder objects), or circuit-tracer's TranscoderSet or
    CrossLayerTranscoder (vlens.replacement). Its logit nodes are the likeliest next tokens until their
    probabilities sum to `desired_logit_prob` (at most `max_n_logits`), or `attribution_targets` (circuit-tracer's):
    token ids, one-token texts, or custom targets (name, weight, vector [d_model]) whose node reads the final norm's
    output with that vector (a logit difference: the difference of two unembedding columns).
    `max_feature_nodes`: keep only that many feature nodes, chosen as circuit-tracer chooses them (by their
    influence on the logits so far, in rounds of 4 x batch_size); None keeps every active feature.
    `batch_size`: targets per backward pass (copies of the prompt in its forward)."""
    model._model()  # (one process: refused under tensor parallelism)
    counts = {"max_n_logits": max_n_logits, "batch_size": batch_size,
              "max_feature_nodes": 1 if max_feature_nodes is None else max_feature_nodes}  # fmt: skip
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            none = " (or None)" if name == "max_feature_nodes" else ""
            raise ValueError(f"{name}: {value!r} is not an int >= 1{none}")
    if not 0.0 < desired_logit_prob <= 1.0:
        raise ValueError(f"desired_logit_prob: {desired_logit_prob!r} is not in (0, 1]")
    check_frozen_attention(model.cfg, "an attribution graph")
    tcs = replacement(model, transcoders)
    tokens = prompt_tokens(model, prompt)
    setup = _Setup(model, tcs, tokens)
    n_layers, n_pos, n_active = model.cfg.num_layers, len(tokens), len(setup.active)
    ids, probs, logit_vectors, names = _logit_targets(model, setup.last_logits, max_n_logits, desired_logit_prob,
                                                      attribution_targets)  # fmt: skip
    wanted = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)

    rows = _Rows(model, tcs, tokens, setup, min(batch_size, max(len(ids), wanted, 1)))
    sources = n_active + (n_layers + 1) * n_pos
    edges = torch.zeros(len(ids) + wanted, sources + len(ids))  # (a column per node: the logits' stay 0)
    row_node = torch.zeros(len(ids) + wanted, dtype=torch.long)  # each row's target: a logit's node, or a feature
    for start in range(0, len(ids), rows.batch):
        chunk = slice(start, min(start + rows.batch, len(ids)))
        n = chunk.stop - chunk.start
        edges[chunk, :sources] = rows(torch.full((n,), n_layers), torch.full((n,), n_pos - 1), logit_vectors[chunk])
        row_node[chunk] = torch.arange(chunk.start, chunk.stop) + sources
    done, filled = torch.zeros(n_active, dtype=torch.bool), len(ids)
    while filled < len(ids) + wanted:
        if wanted == n_active:
            pending = torch.arange(n_active)
        else:
            weights = torch.cat([torch.zeros(sources), probs])
            influence = _influence(_normalised(edges[:filled], 1e-8), weights, row_node[:filled])
            rank = influence[:n_active].argsort(descending=True)
            pending = rank[~done[rank]][: min(4 * rows.batch, len(ids) + wanted - filled)]
            # (a round's features by layer: a batch's backward pass starts at its deepest feature's layer)
            pending = pending[setup.active[pending, 0].argsort(stable=True)]
        for chunk in pending.split(rows.batch):
            at = setup.active[chunk]
            edges[filled : filled + len(chunk), :sources] = rows(at[:, 0], at[:, 1], setup.encoders[chunk])
            row_node[filled : filled + len(chunk)] = chunk
            done[chunk] = True
            filled += len(chunk)

    selected = done.nonzero().squeeze(1)
    return Graph(tokens, setup.active, setup.values, selected, _adjacency(edges, row_node, selected, n_active), ids,
                 probs, n_layers, names)  # fmt: skip


def features_of(tcs: PerLayer | CrossLayer, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Layer `layer`'s features of rows `x` (float32, on the host), none at the first positions."""
    acts = tcs.encode(layer, x.float().cpu())
    acts[:ZERO_POSITIONS] = 0
    return acts


def _logit_targets(
    model: HookedLM, logits: torch.Tensor, most: int, probability: float, targets: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """The logit nodes (see attribute): their ids, weights (probabilities), the vectors they read the final norm's
    output with (a token's: its unembedding column minus the mean column, circuit-tracer's), and their names."""
    vocab, tokenizer = len(logits), model.tokenizer
    probabilities = torch.softmax(logits, -1)
    field = "attribution_targets"
    if targets is None:
        probs, ids = probabilities.topk(min(most, vocab))
        ids = ids[: int(torch.searchsorted(probs.cumsum(0), torch.tensor(probability))) + 1]
    elif isinstance(targets, (list, tuple)) and targets and all(isinstance(t, tuple) for t in targets):
        return _custom_targets(targets, vocab, model.cfg.hidden_size)
    elif isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets):
        if tokenizer is None:
            raise ValueError(f"{field}: texts need a tokenizer, and this model has none; give token ids")
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in targets]
        bad = [(t, i) for t, i in zip(targets, ids) if len(i) != 1]
        if bad:
            raise ValueError(f"{field}: {bad[0][0]!r} is {len(bad[0][1])} tokens ({bad[0][1]}); each must be one token")
        ids = torch.tensor([i[0] for i in ids])
    else:
        ids = torch.as_tensor(targets).reshape(-1) if isinstance(targets, (torch.Tensor, list, tuple)) else None
        if ids is None or not len(ids) or ids.is_floating_point() or not bool(((ids >= 0) & (ids < vocab)).all()):
            raise ValueError(f"{field}: {targets!r} is not None, token ids in 0..{vocab - 1}, one-token texts, or "
                             "(name, weight, vector) custom targets")  # fmt: skip
        ids = ids.long().cpu()
    W_U = model.W_U  # (no float32 copy of the whole unembedding)
    vectors = (W_U[:, ids].float() - W_U.mean(-1, keepdim=True, dtype=torch.float32)).T
    names = [tokenizer.decode([i]) if tokenizer is not None else str(i) for i in ids.tolist()]
    return ids, probabilities[ids], vectors, names


def _custom_targets(
    targets: Sequence[tuple], vocab: int, d_model: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """circuit-tracer's custom targets: (name, weight, vector [d_model]) each, given ids past the vocabulary."""
    for i, target in enumerate(targets):
        ok = len(target) == 3 and isinstance(target[0], str) and isinstance(target[1], (int, float))
        if not ok or not isinstance(target[2], torch.Tensor) or target[2].shape != (d_model,):
            raise ValueError(f"attribution_targets[{i}]: a custom target is (name, weight, vector [{d_model}])")
    names = [t[0] for t in targets]
    ids = torch.arange(vocab, vocab + len(targets))
    return ids, torch.tensor([float(t[1]) for t in targets]), torch.stack([t[2].float().cpu() for t in targets]), names


def _adjacency(edges: torch.Tensor, row_node: torch.Tensor, selected: torch.Tensor, n_active: int) -> torch.Tensor:
    """The rows computed (logits' and features', each row's target in `row_node`) laid out as the graph's nodes: the
    selected features' rows and columns, the error and token columns, the logits' rows last."""
    n_logits = len(row_node) - len(selected)
    columns = torch.cat([selected, torch.arange(n_active, edges.shape[1] - n_logits)])
    n_nodes = len(columns) + n_logits
    adjacency = torch.zeros(n_nodes, n_nodes)
    order = row_node.argsort()  # features in index order, then the logits
    adjacency[: len(selected), : len(columns)] = edges[order[: len(selected)]][:, columns]
    adjacency[len(columns) :, : len(columns)] = edges[order[len(selected) :]][:, columns]
    return adjacency


def prompt_tokens(model: HookedLM, prompt: str | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The prompt's token ids, a special token first (BOS, else PAD, else EOS) where the tokenizer knows one and
    the prompt does not start with one."""
    tokenizer = model.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: a text needs a tokenizer, and this model has none; pass token ids")
        ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
    else:
        ids = torch.as_tensor(prompt).reshape(-1).long().cpu()
    if not len(ids) or not bool(((ids >= 0) & (ids < model.cfg.vocab_size)).all()):
        raise ValueError(f"prompt: token ids in 0..{model.cfg.vocab_size - 1}, at least one; got {ids.tolist()[:8]}")
    if tokenizer is not None and int(ids[0]) not in tokenizer.all_special_ids:
        special = (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id)
        first = next((t for t in special if t is not None), None)
        if first is not None:
            ids = torch.cat([torch.tensor([first]), ids])
    return ids


class _Setup:
    """The prompt's forward: each layer's active features (zeroed at the first positions), their encoder rows, what
    they write to each layer's MLP output (activation-scaled decoder rows), the error there, the token embeddings,
    the last logits."""

    def __init__(self, model: HookedLM, tcs: PerLayer | CrossLayer, tokens: torch.Tensor):
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens[None], names_filter=[*tcs.reads, *tcs.writes, "hook_embed"])
        self.last_logits = logits[0, -1].float()
        inputs = [cache[name][0].flatten(1).float().cpu() for name in tcs.reads]
        active, values, encoders = [], [], []
        for layer, x in enumerate(inputs):
            acts = features_of(tcs, layer, x)
            at = acts.nonzero()
            active.append(torch.cat([torch.full((len(at), 1), layer), at], 1))
            values.append(acts[at[:, 0], at[:, 1]])
            encoders.append(tcs.encoder_rows(layer, at[:, 1]))
        self.active, self.values, self.encoders = torch.cat(active), torch.cat(values), torch.cat(encoders)
        first = [0, *torch.bincount(self.active[:, 0], minlength=len(inputs)).cumsum(0).tolist()]
        writing: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in inputs]
        for layer in range(len(inputs)):  # (each layer's features' decoders read once, for all they write to)
            ids = torch.arange(first[layer], first[layer + 1])
            rows = self.values[ids, None, None] * tcs.decoder_rows(layer, self.active[ids, 2])
            for j, out in enumerate(tcs.targets(layer)):
                writing[out].append((ids, rows[:, j]))
        # per layer: the features writing there and what they write
        self.writes = [(torch.cat([i for i, _ in w]), torch.cat([v for _, v in w])) for w in writing]
        errors = []
        for out, x in enumerate(inputs):
            ids, vectors = self.writes[out]
            written = tcs.constant(out, x).index_add(0, self.active[ids, 1], vectors)
            error = cache[tcs.writes[out]][0].flatten(1).float().cpu() - written
            error[:ZERO_POSITIONS] = 0
            errors.append(error)
        self.errors = torch.stack(errors)  # [n_layers, n_pos, d_model]
        self.embeddings = cache["hook_embed"][0].float().cpu()


class _Rows:
    """The replacement model's forward over `batch` copies of the prompt, kept with its graph: patterns and norm
    divisors frozen (detached), each MLP output detached but for a skip connection, the stream each target reads
    kept; backward hooks at each MLP output and the embeddings dot the gradient with what each node wrote there.
    Called with targets (their layer: n_layers for the logits, their position, the vector they read with), it
    returns their rows of direct effects [targets, sources]."""

    def __init__(self, model: HookedLM, tcs: PerLayer | CrossLayer, tokens: torch.Tensor, setup: _Setup, batch: int):
        n, device = len(tcs.reads), model.cfg.device
        self.batch, self.n_layers, self.n_pos, self.n_active = batch, n, len(tokens), len(setup.active)
        # (what each node wrote, on the model's device in float32: the rows are summed there, then copied off once)
        positions = setup.active[:, 1]
        self.writes = [(ids.to(device), positions[ids].to(device), v.to(device)) for ids, v in setup.writes]
        self.errors, self.embeddings = setup.errors.to(device), setup.embeddings.to(device)
        # each layer's transcoder input, then the final norm's output: what the targets read
        self.reads: list[torch.Tensor | None] = [None] * (n + 1)
        self.buffer: torch.Tensor | None = None  # [sources, batch] of the backward pass running

        def freeze(value: torch.Tensor, hook: Any) -> torch.Tensor:
            return value.detach()

        def keep(layer: int, value: torch.Tensor, hook: Any) -> None:
            self.reads[layer] = value

        def skip_only(layer: int, value: torch.Tensor, hook: Any) -> torch.Tensor:
            x = self.reads[layer].flatten(2)
            skip = tcs.skip(layer, x)
            skip = x[..., :1] * 0 if skip is None else skip.view_as(value)  # (no skip: 0, on the graph)
            return skip + (value - skip).detach()

        kinds = lambda layer: ("attn.hook_q", "attn.hook_k",  # noqa: E731 - (each layer's norms)
                               *(f"{norm}.hook_scale" for norm in layer_norms(model.cfg, layer)))
        frozen = [f"blocks.{layer}.{kind}" for layer in range(n) for kind in kinds(layer)] + ["ln_final.hook_scale"]
        fwd = [(name, freeze) for name in frozen]
        fwd += [(hook, partial(keep, layer)) for layer, hook in enumerate(tcs.reads)]
        fwd += [(hook, partial(skip_only, layer)) for layer, hook in enumerate(tcs.writes)]
        fwd.append((FINAL_NORM, partial(keep, n)))
        bwd = [(hook, partial(self._written, layer)) for layer, hook in enumerate(tcs.writes)]
        bwd.append(("hook_embed", self._embedded))
        with torch.enable_grad(), model.hooks(fwd, bwd):
            model(tokens[None].expand(batch, -1), return_type=None)

    def _written(self, layer: int, grad: torch.Tensor, hook: Any) -> None:
        """At layer `layer`'s MLP output: the rows of the features writing there and of its error nodes."""
        grad = grad.float().flatten(2)  # [batch, pos, d_model]
        ids, positions, vectors = self.writes[layer]
        self.buffer.index_add_(0, ids, torch.einsum("bfd,fd->fb", grad[:, positions], vectors))
        start = self.n_active + layer * self.n_pos
        self.buffer[start : start + self.n_pos] += torch.einsum("bpd,pd->pb", grad, self.errors[layer])

    def _embedded(self, grad: torch.Tensor, hook: Any) -> None:
        start = self.n_active + self.n_layers * self.n_pos
        self.buffer[start:] += torch.einsum("bpd,pd->pb", grad.float(), self.embeddings)

    def __call__(self, layers: torch.Tensor, positions: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        n_sources = self.n_active + (self.n_layers + 1) * self.n_pos
        self.buffer = torch.zeros(n_sources, self.batch, device=self.embeddings.device)
        targets = torch.arange(len(layers))
        handles = []
        for layer in layers.unique().tolist():
            mine = layers == layer
            read = self.reads[layer]
            values = vectors[mine].to(read.device, read.dtype).view(-1, *read.shape[2:])
            handles.append(read.register_hook(partial(_inject, targets[mine], positions[mine], values)))
        try:
            last = self.reads[int(layers.max())]
            last.backward(torch.zeros_like(last), retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        rows, self.buffer = self.buffer.T[: len(layers)].cpu(), None
        return rows


def _inject(targets: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient at a stream some targets read: each target's own vector at its copy and position."""
    grad = grad.clone()
    grad[targets, positions] = values
    return grad


def to_circuit_tracer(graph: Graph, model: HookedLM, scan: str | list[str] | None = None) -> Any:
    """`graph` as circuit-tracer's own Graph (circuit_tracer installed), for its tools: `create_graph_files(graph,
    slug, output_path)` writes the JSON its viewer and Neuronpedia draw, `graph.to_pt(path)` saves it. `scan`
    names the transcoders (circuit-tracer's; needed to upload). Its config names the model's checkpoint
    directory as the tokenizer to decode tokens with."""
    from circuit_tracer.attribution.targets import LogitTarget
    from circuit_tracer.graph import Graph as TracerGraph
    from circuit_tracer.utils.tl_nnsight_mapping import UnifiedConfig

    cfg, path = model.cfg, str(model.llm.model_path)
    config = UnifiedConfig(
        n_layers=cfg.num_layers, d_model=cfg.hidden_size, d_head=cfg.head_dim, n_heads=cfg.num_heads,
        d_mlp=cfg.intermediate_size, d_vocab=cfg.vocab_size, tokenizer_name=path, model_name=model.llm.model_name,
        original_architecture=cfg.architecture, n_key_value_heads=cfg.num_kv_heads,
    )  # fmt: skip
    decode = model.tokenizer.decode if model.tokenizer is not None else str
    ids = graph.logit_tokens.tolist()
    targets = [LogitTarget(token_str=name, vocab_idx=t) for name, t in zip(graph.logit_names, ids)]
    return TracerGraph(
        input_string=decode(graph.input_tokens.tolist()), input_tokens=graph.input_tokens,
        active_features=graph.active_features, adjacency_matrix=graph.adjacency_matrix, cfg=config,
        selected_features=graph.selected_features, activation_values=graph.activation_values,
        logit_targets=targets, logit_probabilities=graph.logit_probabilities, scan=scan,
    )  # fmt: skip


# -- reading a graph: what carries the logits ------------------------------------------------------------------


class Pruned(NamedTuple):
    node_mask: torch.Tensor  # [nodes] bool
    edge_mask: torch.Tensor  # [nodes, nodes] bool, as the adjacency: target row, source column
    cumulative_scores: torch.Tensor  # [nodes]


def prune_graph(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's pruning: which nodes and edges carry most of the influence on the logits. A node's
    influence is its total effect on the logits (weighted by their probabilities) through paths of absolute,
    row-normalised edges; the nodes holding `node_threshold` of all influence are kept (tokens and logits always),
    then of the edges among them those holding `edge_threshold` of the edge influence, then, until nothing
    changes, features and errors with no kept edge out and features with no kept edge in are dropped.
    cumulative_scores: the share of all influence of the nodes at least as influential as each."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: {value!r} is not in [0, 1]")
    A, fixed = graph.adjacency_matrix, len(graph.logit_tokens) + graph.n_pos  # (tokens and logits: the last nodes)
    weights = _logit_weights(graph)
    influence = _influence(_normalised(A), weights)
    nodes = influence >= _keeping(influence, node_threshold)
    nodes[-fixed:] = True
    pruned = A * nodes[:, None] * nodes[None, :]
    normalised = _normalised(pruned)
    edge_scores = normalised * (_influence(normalised, weights) + weights)[:, None]
    edges = edge_scores >= _keeping(edge_scores.flatten(), edge_threshold)
    n_features = graph.n_features
    while True:
        before = nodes.clone()
        nodes[:-fixed] &= edges[:, :-fixed].any(0)  # (features and errors write to something kept)
        nodes[:n_features] &= edges[:n_features].any(1)  # (features read from something kept)
        edges &= nodes[:, None] & nodes[None, :]
        if torch.equal(nodes, before):
            break
    scores, order = influence.sort(descending=True)
    cumulative = torch.empty_like(influence)
    cumulative[order] = scores.cumsum(0) / scores.sum()
    return Pruned(nodes, edges, cumulative)


def graph_scores(graph: Graph) -> tuple[float, float]:
    """circuit-tracer's (replacement score, completeness score): the share of the tokens' and errors' influence on
    the logits that is the tokens' (reaching the logits through features alone), and the influence-weighted
    share of every node's inputs that comes from features and tokens rather than errors."""
    errors = slice(graph.n_features, graph.n_features + graph.n_layers * graph.n_pos)
    tokens = slice(errors.stop, errors.stop + graph.n_pos)
    weights = _logit_weights(graph)
    normalised = _normalised(graph.adjacency_matrix)
    influence = _influence(normalised, weights)
    from_tokens, from_errors = influence[tokens].sum(), influence[errors].sum()
    replacement = from_tokens / (from_tokens + from_errors)
    outputs = influence + weights
    completeness = ((1 - normalised[:, errors].sum(-1)) * outputs).sum() / outputs.sum()
    return replacement.item(), completeness.item()


def _logit_weights(graph: Graph) -> torch.Tensor:
    weights = torch.zeros(len(graph.adjacency_matrix))
    weights[len(weights) - len(graph.logit_tokens) :] = graph.logit_probabilities
    return weights


def _normalised(A: torch.Tensor, floor: float = 1e-10) -> torch.Tensor:
    """|A| with each row summing to 1 (a row summing to less than `floor` is divided by the floor)."""
    A = A.abs()
    return A / A.sum(1, keepdim=True).clamp(min=floor)


def _influence(normalised: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """w A + w A² + ... over nodes: the influence on the logits (weighted `weights`) of each node through paths of
    `normalised` edges; `rows`: the node each row is the target of, where only some rows are known (attribute's
    feature ranking, circuit-tracer's partial influence). Edges point back in the forward, so the series ends."""
    total, step = torch.zeros_like(weights), weights
    for _ in range(len(weights) + 1):
        step = (step if rows is None else step[rows]) @ normalised
        if not step.any():
            return total
        total += step
    raise RuntimeError("attribution graph: its edges form a cycle; their influence does not end")


def _keeping(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score above which (inclusive) the highest scores hold `fraction` of their sum."""
    ordered = scores.sort(descending=True).values
    shares = ordered.cumsum(0) / ordered.sum()
    return ordered[min(int(torch.searchsorted(shares, torch.tensor(fraction))), len(ordered) - 1)]
