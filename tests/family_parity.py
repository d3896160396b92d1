"""The scaffolding of the per-family parity tests (test_parity_<family>.py): a tiny random checkpoint saved
and read back from disk, compared with HF (hf_reference.py) tap by tap, packed against alone, and through
the engine's greedy generation against HF generate. A family file keeps only its configs and what is
particular to it:

    family = family_fixture(CONFIGS)          # (name, path, llm, hf) for each config, built once a module

    class TestParity(TapParity, GenerationParity):
        generation_hooks = ("hook_pos_embed",)  # what this family adds to the shared checks

Not a test module. HF initialises norms to one (Gemma: zero) and biases to zero, which would let a model
that ignores them pass; `build` re-saves the checkpoint with those weights perturbed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_auto_class, rel_err, save_tiny
from hf_reference import hf_taps, rows_shape, same
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from vlens import LLM, Capture, SamplingParams, Steer
from vlens.capture.names import is_pattern

TOL = 1e-5  # forward, float32
GEN_TOL = 1e-4  # through generation
FEATURE_TOL = 1e-3  # how far the logits must move when a feature is turned off in HF
VOCAB = 300
SEQ_LENS = (1, 23, 40)  # the longer ones outrun every window and every original rope context of the configs
COMMON = {  # sizes every tiny config shares (GPT-2 spells them its own way)
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "initializer_range": 0.1,  # larger than HF's 0.02 so attention is far from uniform
}


def perturb_norms_and_biases(path: Path, seed: int = 1) -> None:
    """Rewrite the checkpoint with every 1-d weight (norm scales), every bias, every sink, every layer scalar and
    router scale (Gemma 4's) and every xIELU alpha (Apertus's) moved off its init."""
    file = path / "model.safetensors"
    weights = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for key, w in weights.items():
        if (key.endswith(".weight") and w.dim() == 1) or key.endswith(("bias", ".sinks", ".layer_scalar", ".scale",
                                                                          ".per_expert_scale", ".alpha_p", ".alpha_n")):
            weights[key] = w + 0.3 * torch.randn(w.shape, generator=g)
    save_file(weights, file, metadata={"format": "pt"})


def build(config, root: Path, name: str) -> str:
    path = root / name
    save_tiny(config, path)
    perturb_norms_and_biases(path)
    return str(path)


def transformer_lens_gpt2(root: Path, initializer_range: float = 0.02) -> tuple[str, torch.nn.Module]:
    """A tiny GPT-2 (3 layers, d=64) saved for vlens, and TransformerLens's HookedTransformer with the same weights,
    unprocessed (no folding, no centring): the reference of the tests that run TransformerLens's own calls."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2Config

    path = build(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                            initializer_range=initializer_range), root, "gpt2")  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = HookedTransformerConfig(n_layers=3, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=VOCAB, n_ctx=128,
                                  act_fn="gelu_new", normalization_type="LN")  # fmt: skip
    reference = HookedTransformer(cfg)
    reference.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    return path, reference


def transformer_lens_llama(root: Path) -> tuple[str, torch.nn.Module]:
    """A tiny Llama with grouped-query attention (4 query heads over 2 key-value heads), saved for vlens, and
    TransformerLens's HookedTransformer with the same weights: its RMSNorm, rotary and grouped-query attention."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights
    from transformers import LlamaConfig

    path = build(LlamaConfig(**COMMON, num_key_value_heads=2, rms_norm_eps=1e-6), root, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = HookedTransformerConfig(n_layers=3, d_model=64, d_head=16, n_heads=4, n_key_value_heads=2, d_mlp=96,
                                  d_vocab=VOCAB, n_ctx=128, act_fn="silu", normalization_type="RMS", eps=1e-6,
                                  positional_embedding_type="rotary", rotary_dim=16, rotary_base=10000, final_rms=True,
                                  gated_mlp=True, original_architecture="LlamaForCausalLM")  # fmt: skip
    reference = HookedTransformer(cfg)
    reference.load_state_dict(convert_llama_weights(hf, cfg), strict=False)
    return path, reference


def transformer_lens_gemma2(root: Path) -> tuple[str, torch.nn.Module]:
    """A tiny Gemma 2 (grouped-query attention, both soft-caps, post-norms; a window longer than the tests' texts)
    saved for vlens, and TransformerLens's HookedTransformer with the same weights."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gemma_weights
    from transformers import Gemma2Config

    config = Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=128, query_pre_attn_scalar=16,
                          attn_logit_softcapping=20.0, final_logit_softcapping=10.0, rms_norm_eps=1e-6)  # fmt: skip
    path = build(config, root, "gemma2")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = HookedTransformerConfig(n_layers=3, d_model=64, d_head=16, n_heads=4, n_key_value_heads=2, d_mlp=96,
                                  d_vocab=VOCAB, n_ctx=128, act_fn="gelu_pytorch_tanh", normalization_type="RMS",
                                  eps=1e-6, positional_embedding_type="rotary", rotary_dim=16, rotary_base=10000.0,
                                  use_attn_scale=True, attn_scores_soft_cap=20.0, output_logits_soft_cap=10.0,
                                  gated_mlp=True, final_rms=True, use_normalization_before_and_after=True,
                                  original_architecture="Gemma2ForCausalLM")  # fmt: skip
    reference = HookedTransformer(cfg)
    reference.load_state_dict(convert_gemma_weights(hf, cfg), strict=False)
    return path, reference


def check_transformer_lens_names(
    path: str, convert, kinds: set[str], settings: dict | None = None, weights: tuple[str, ...] = (),
    differ: frozenset[str] = frozenset(),
) -> None:  # fmt: skip
    """TransformerLens's own model of the checkpoint at `path` (its config `settings`, or read from the checkpoint
    where TransformerLens can; its weight conversion `convert`) on the same weights: logits within 1e-5, and
    HookedLM's cache holds the same values
    under every name both have, `kinds` of layer hooks among them (TransformerLens's hook_rot_q / hook_rot_k are
    vlens's hook_q / hook_k where it has them; its MoE taps are [pos, ...] of the batch's one text), but the layer
    hook kinds in `differ`, where vlens follows HF and TransformerLens does not; and HookedLM's `weights` (W_Q, b_O,
    ...) are TransformerLens's."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.loading_from_pretrained import convert_hf_model_config

    from vlens import HookedLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if settings is None:
        settings = convert_hf_model_config(path) | {"dtype": torch.float32, "tokenizer_name": None}
    reference = HookedTransformer(HookedTransformerConfig(**settings))
    reference.load_state_dict(convert(hf, reference.cfg), strict=False)
    tokens = torch.tensor([sequences()[-1]])
    hooked = HookedLM(path, dtype="float32", device="cpu")
    for weight in weights:
        assert torch.equal(getattr(hooked, weight), getattr(reference, weight)), weight
    logits, cache = hooked.run_with_cache(tokens)
    with torch.no_grad():
        ref_logits, ref_cache = reference.run_with_cache(tokens)
    assert rel_err(logits, ref_logits) <= 1e-5
    rotary = any("hook_rot_" in name for name in ref_cache)  # (then TransformerLens's hook_q / hook_k: before it)
    renamed = {name.replace("hook_rot_", "hook_"): name for name in ref_cache
               if not rotary or ("hook_q" not in name and "hook_k" not in name)}  # fmt: skip
    common = sorted(name for name in set(renamed) & set(cache) if name.split(".", 2)[-1] not in differ)
    assert kinds <= {name.split(".", 2)[-1] for name in common if name.startswith("blocks.")}
    for name in common:
        ours, theirs = cache[name], ref_cache[renamed[name]]
        assert same(ours.reshape(theirs.shape).float(), theirs.float(), 1e-5), name


def load_pair(path: str, **settings) -> tuple[LLM, torch.nn.Module]:
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, **settings)
    hf = hf_auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32).eval()
    return llm, hf


def family_fixture(configs: dict, name: str = "family", **settings):
    """The module-scoped fixture (`family` unless named otherwise) of a parity file: for each of `configs`
    (name -> a function making the transformers config), (name, checkpoint path, vlens LLM with 4-token
    blocks and `settings`, HF model)."""

    @pytest.fixture(scope="module", params=list(configs), name=name)
    def family(request, tmp_path_factory):
        path = build(configs[request.param](), tmp_path_factory.mktemp(request.param), request.param)
        return request.param, path, *load_pair(path, **settings)

    return family


def sequences(lengths=SEQ_LENS, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def check_every_tap(llm: LLM, hf, seqs: list[list[int]], tol: float = TOL, required=()) -> None:
    """Every hook of the model that HF has a counterpart for, on every sequence of one packed trace; the
    hooks in `required` (spelled out by a test, so that a renamed or dropped hook fails) must be among them."""
    shapes = llm.hook_names()
    assert not set(required) - set(shapes), sorted(set(required) - set(shapes))
    outs = llm.trace(seqs, hooks=list(shapes))
    failures, compared = [], set()
    for ids, got in zip(seqs, outs):
        ref = hf_taps(hf, ids, range(llm.config.num_layers))
        for hook, value in got.items():
            assert tuple(value.shape) == rows_shape(shapes[hook], len(ids)), hook
            if hook not in ref:
                continue
            compared.add(hook)
            assert value.shape == ref[hook].shape, hook
            if hook.endswith(("hook_expert_ids", "hook_expert_indices")):
                ok = torch.equal(value, ref[hook])
            else:
                ok = same(value, ref[hook], tol)
            if not ok:
                failures.append(f"len {len(ids)} {hook}: rel_err {rel_err(value.double(), ref[hook].double()):.3g}")
    assert not failures, failures
    # HF has a counterpart for every hook (vlens has none of its own) except where a test says otherwise.
    assert compared == set(shapes), sorted(set(shapes) - compared)


def check_packed_equals_alone(llm: LLM, seqs: list[list[int]]) -> None:
    hooks = list(llm.hook_names())
    packed = llm.trace(seqs, hooks=hooks)
    for ids, together in zip(seqs, packed):
        alone = llm.trace([ids], hooks=hooks)[0]
        for hook in hooks:
            assert same(together[hook].double(), alone[hook].double(), TOL), (len(ids), hook)


def check_generation(llm: LLM, hf, prompts: list[list[int]], max_tokens: int = 8, extra_hooks=()) -> list:
    """Greedy generation through the engine (all prompts in one batch) against HF generate of each prompt
    alone: same tokens, and every hidden state of every row within GEN_TOL. Returns the outputs."""
    n = llm.config.num_layers
    hooks = [f"hidden_states.{i}" for i in range(n + 1)] + list(extra_hooks)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            g = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                eos_token_id=None,  # run on past EOS, as ignore_eos does (min_new_tokens would ban EOS instead)
                do_sample=False,
                output_hidden_states=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == g.sequences[0, len(prompt) :].tolist()
        for i in range(n + 1):
            ref = torch.cat([step[i][0] for step in g.hidden_states])
            assert rel_err(out.activations[f"hidden_states.{i}"], ref) <= GEN_TOL, i
    return outs


def check_bfloat16_taps(config, root: Path) -> None:
    """On a checkpoint of `config` in bfloat16, every tap with an HF counterpart equals HF's (its default attention,
    SDPA) bit for bit; the patterns, which HF's eager attention gives, are not compared."""
    path = build(config, root, "bf16")
    llm = LLM(model=path, dtype="bfloat16", device="cpu")
    hf = hf_auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.bfloat16).eval()
    ids, layers = sequences()[-1], llm.config.num_layers
    got, ref = llm.trace([ids], hooks=list(llm.hook_names()))[0], hf_taps(hf, ids, range(layers), patterns=False)
    compared = [hook for hook in got if hook in ref]
    assert compared == [hook for hook in got if not is_pattern(hook)]  # (all but the patterns)
    # (an MoE router's softmax is float32 in HF; vlens's taps are of the model's dtype)
    assert [hook for hook in compared if not torch.equal(got[hook], ref[hook].to(got[hook].dtype))] == []


def check_feature_matters(config, root: Path, **hf_overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """On a checkpoint of `config`, vlens's logits for the longest test sequence differ from HF's with a
    feature turned off (`hf_overrides` for from_pretrained): else the sequences would not reach the feature
    and the parity would prove nothing about it. Returns both."""
    path = build(config, root, "feature")
    llm = LLM(model=path, dtype="float32", device="cpu")
    auto = hf_auto_class(AutoConfig.from_pretrained(path))
    without = auto.from_pretrained(path, dtype=torch.float32, **hf_overrides).eval()
    ids = sequences()[-1]
    got = llm.trace([ids], hooks="unembed.hook_out")[0]["unembed.hook_out"]
    with torch.no_grad():
        ref = without(torch.tensor([ids])).logits[0]
    assert rel_err(got, ref) > FEATURE_TOL
    return got, ref


class TapParity:
    """Every tap against HF, and packed against alone, on each checkpoint of the module's `family` fixture.
    A family file runs them by subclassing (in a class named Test...); `required_hooks(llm)` names the hooks
    it spells out."""

    def required_hooks(self, llm: LLM) -> list[str]:
        return []

    def test_every_tap_matches_hf(self, family):
        _, _, llm, hf = family
        check_every_tap(llm, hf, sequences(), required=self.required_hooks(llm))

    def test_packed_equals_alone(self, family):
        check_packed_equals_alone(family[2], sequences())


class GenerationParity:
    """Greedy generation through the paged cache (4-token blocks) against HF generate, prompts of
    `generation_lengths` in one batch, capturing every hidden state and `generation_hooks`."""

    generation_lengths = (20, 9, 3)
    generation_hooks: tuple[str, ...] = ()

    def test_generation_matches_hf(self, family):
        _, _, llm, hf = family
        check_generation(llm, hf, sequences(self.generation_lengths), extra_hooks=self.generation_hooks)


def check_capturing_step_compiles(path: str, hook: str, **settings) -> None:
    """torch.compile(fullgraph=True) of a mixed step of the checkpoint at `path` (two sequences decode while two
    prefill), one request capturing `hook` and the last layer's stream, one steering `hook`: no graph break, one
    compile, the eager step's stream and rows (test_compile.py's CompiledForward checks them)."""
    from test_compile import CompiledForward

    from vlens.engine.llm_engine import NewRequest

    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, **settings)
    last = f"blocks.{llm.config.num_layers - 1}.hook_resid_post"
    vector = torch.randn(llm.hook_names()[hook], generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=Capture([hook, last])),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, interventions=[Steer(hook, vector)])]
    engine = llm.engine
    engine.runner.taps.fixed_shapes = True
    try:
        engine.add_requests([NewRequest(ids, p) for ids, p in zip(sequences((5, 7)), params)])
        engine.step()  # (their prefill, eager)
        forward = engine.runner.forward = CompiledForward(llm.model)
        engine.add_requests([NewRequest(ids, p) for ids, p in zip(sequences((70, 9)), params)])
        engine.step()
    finally:
        engine.runner.taps.fixed_shapes = False
    assert forward.compiles == 1 and max(forward.errors) < 1e-5


def check_compiled_decode(path: str, hooks: list[str]) -> None:
    """compile_decode on the checkpoint at `path`: the decode steps (a stateful layer's states read and written
    through index buffers) compiled by inductor, capturing `hooks`: the eager engine's tokens and rows."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
    prompts = sequences((9, 14, 3))
    compiled = LLM(model=path, dtype="float32", device="cpu", compile_decode=True)
    eager = LLM(model=path, dtype="float32", device="cpu", enforce_eager=True)
    outs = compiled.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False)
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for hook, rows in a.activations.items():
            assert rel_err(rows, b.activations[hook]) <= 1e-5, hook
    assert compiled.runner.graph_stats.compiled_steps > 0


def check_generation_under_pressure(
    path: str, kv_cache_memory: int, hook: str, lengths=(100, 90, 80), batched: int = 32, max_num_seqs: int = 3,
    preempts: bool = True, **settings,
) -> LLM:  # fmt: skip
    """Greedy generation (check_generation, capturing `hook`) of prompts of `lengths` fed `batched` tokens a step,
    with `kv_cache_memory` bytes for keys and state slots (small enough to preempt where `preempts`), the decode steps
    replayed from emulated CUDA graphs (replayed_graphs.py). Returns the engine for the test's own checks."""
    from replayed_graphs import replay_graphs

    _, hf = load_pair(path)
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=batched,
              max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory, **settings)  # fmt: skip
    replay_graphs(llm.runner)
    check_generation(llm, hf, sequences(lengths), max_tokens=10, extra_hooks=(hook,))
    stats = llm.runner.graph_stats
    assert stats.graph_steps > 0 and stats.eager_steps > 3
    assert (llm.engine.scheduler.num_preemptions > 0) == preempts
    return llm
