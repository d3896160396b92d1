"""Hook names: how specs resolve, what hook_names() promises, input errors of trace(), and that a trace
runs no more of the model, and no more capture code, than the requested hooks need."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny
from hf_reference import rows_shape
from transformers import LlamaConfig

import vlens.models.base as model_base
from vlens import LLM
from vlens.capture.names import (
    FINAL_NORM,
    FINAL_NORM_TAPS,
    LAYER_HOOKS,
    LOGITS,
    HookSpecError,
    hook_shapes,
    resolve_hooks,
)

N_LAYERS, HEADS, KV_HEADS, HEAD_DIM, D, FFN, VOCAB = 4, 4, 2, 8, 64, 96, 300
IDS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=FFN,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,  # not D / HEADS, so shapes tell the two apart
        max_position_embeddings=64,
    )
    path = save_tiny(config, tmp_path_factory.mktemp("hooks") / "ckpt")
    return LLM(model=path, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def cfg(tiny):
    return tiny.config


# --- resolution -------------------------------------------------------------------------------------


def test_exact_name(cfg):
    assert resolve_hooks("blocks.1.hook_resid_post", cfg) == {"blocks.1.hook_resid_post": "blocks.1.hook_resid_post"}
    assert resolve_hooks("unembed.hook_out", cfg) == {LOGITS: LOGITS}


def test_glob(cfg):
    assert list(resolve_hooks("blocks.*.hook_resid_post", cfg)) == [
        f"blocks.{i}.hook_resid_post" for i in range(N_LAYERS)
    ]
    attn = ["q", "k", "v", "attn_scores", "pattern", "z"]
    assert list(resolve_hooks("blocks.2.attn.*", cfg)) == [f"blocks.2.attn.hook_{x}" for x in attn]
    assert len(resolve_hooks("*", cfg)) == len(hook_shapes(cfg))


def test_brace_list_and_range(cfg):
    assert list(resolve_hooks("blocks.{3,1}.hook_attn_out", cfg)) == ["blocks.1.hook_attn_out", "blocks.3.hook_attn_out"]
    assert list(resolve_hooks("blocks.{0..2}.ln1.hook_normalized", cfg)) == [
        f"blocks.{i}.ln1.hook_normalized" for i in range(3)
    ]
    # Several braces, and braces mixed with a glob; results come in forward order.
    assert list(resolve_hooks("blocks.{0..1}.attn.hook_{k,q}", cfg)) == [
        "blocks.0.attn.hook_q",
        "blocks.0.attn.hook_k",
        "blocks.1.attn.hook_q",
        "blocks.1.attn.hook_k",
    ]
    assert list(resolve_hooks("blocks.{1,3}.*mlp*", cfg)) == [
        "blocks.1.mlp.hook_post",
        "blocks.1.hook_mlp_out",
        "blocks.3.mlp.hook_post",
        "blocks.3.hook_mlp_out",
    ]


def test_list_of_specs_is_deduplicated_and_in_forward_order(cfg):
    got = resolve_hooks(["unembed.hook_out", "blocks.*.hook_resid_pre", "blocks.0.hook_resid_pre", "hook_embed"], cfg)
    assert list(got) == ["hook_embed"] + [f"blocks.{i}.hook_resid_pre" for i in range(N_LAYERS)] + [LOGITS]
    assert resolve_hooks(("blocks.0.hook_attn_out",), cfg) == {"blocks.0.hook_attn_out": "blocks.0.hook_attn_out"}


def test_hidden_states_aliases(cfg):
    got = resolve_hooks("hidden_states.*", cfg)
    assert got == {
        "hidden_states.0": "blocks.0.hook_resid_pre",
        "hidden_states.1": "blocks.1.hook_resid_pre",
        "hidden_states.2": "blocks.2.hook_resid_pre",
        "hidden_states.3": "blocks.3.hook_resid_pre",
        "hidden_states.4": FINAL_NORM,  # HF's last entry is after the final norm
    }
    assert resolve_hooks(["hidden_states.2", "blocks.2.hook_resid_pre"], cfg) == {
        "blocks.2.hook_resid_pre": "blocks.2.hook_resid_pre",
        "hidden_states.2": "blocks.2.hook_resid_pre",
    }


def test_aliases_trace_the_same_values(tiny):
    out = tiny.trace(IDS, hooks=["hidden_states.*", "hook_embed", "blocks.*.hook_resid_{pre,post}", FINAL_NORM])
    for o, ids in zip(out, IDS):
        assert torch.equal(o["hidden_states.0"], o["hook_embed"])
        for i in range(N_LAYERS):
            assert torch.equal(o[f"hidden_states.{i}"], o[f"blocks.{i}.hook_resid_pre"])
        for i in range(N_LAYERS - 1):
            assert torch.equal(o[f"blocks.{i}.hook_resid_post"], o[f"blocks.{i + 1}.hook_resid_pre"])
        assert torch.equal(o[f"hidden_states.{N_LAYERS}"], o[FINAL_NORM])
        assert not torch.allclose(o[f"blocks.{N_LAYERS - 1}.hook_resid_post"], o[FINAL_NORM])
        assert o["hook_embed"].shape == (len(ids), D)


@pytest.mark.parametrize(
    ("spec", "named", "suggested"),
    [
        ("blocks.0.hook_resid_psot", "'blocks.0.hook_resid_psot'", "blocks.0.hook_resid_post"),
        ("blocks.7.hook_attn_out", "'blocks.7.hook_attn_out'", "blocks.3.hook_attn_out"),
        ("blocks.1.attn.hook_r", "'blocks.1.attn.hook_r'", "blocks.1.attn.hook_q"),
        ("hidden_states.5", "'hidden_states.5'", "hidden_states.4"),
        ("resid_post", "'resid_post'", None),
        ("blocks.*.hook_resid_middle", "'blocks.*.hook_resid_middle'", None),
        # A spelled-out brace alternative the model lacks is an error, not silently dropped.
        ("blocks.{1,7}.hook_mlp_out", "'blocks.7.hook_mlp_out' (from 'blocks.{1,7}.hook_mlp_out')", "blocks.1.hook_mlp_out"),
        ("blocks.{0..5}.hook_resid_post", "'blocks.4.hook_resid_post'", "blocks.3.hook_resid_post"),
    ],
)
def test_unknown_names(cfg, tiny, spec, named, suggested):
    for call in (lambda: resolve_hooks(spec, cfg), lambda: tiny.trace(IDS, hooks=[spec])):
        with pytest.raises(HookSpecError) as err:
            call()
        message = str(err.value)
        assert isinstance(err.value, ValueError)
        assert message.startswith("hooks: ") and named in message
        assert f"{N_LAYERS} layers" in message and "`vlens hooks`" in message
        if suggested:
            assert "closest valid names" in message and suggested in message


def test_one_bad_name_in_a_list_fails_the_whole_spec(tiny):
    with pytest.raises(HookSpecError, match="'blocks.0.hook_nope'"):
        tiny.trace(IDS, hooks=["blocks.0.hook_resid_post", "blocks.0.hook_nope"])


@pytest.mark.parametrize("spec", [[], (), [3], ["blocks.0.hook_resid_post", None]])
def test_malformed_specs(cfg, spec):
    with pytest.raises(HookSpecError, match="^hooks: "):
        resolve_hooks(spec, cfg)


# --- hook_names() -----------------------------------------------------------------------------------


def test_hook_names_contents_and_shapes(tiny):
    names = tiny.hook_names()
    expected = ["hook_embed"]
    expected += [f"blocks.{i}.{h}" for i in range(N_LAYERS) for h in LAYER_HOOKS]
    expected += [*FINAL_NORM_TAPS, LOGITS] + [f"hidden_states.{i}" for i in range(N_LAYERS + 1)]
    assert list(names) == expected  # forward order
    assert len(LAYER_HOOKS) == 18
    for i in range(N_LAYERS):
        p = f"blocks.{i}."
        assert names[p + "attn.hook_q"] == (HEADS, HEAD_DIM)
        assert names[p + "attn.hook_z"] == (HEADS, HEAD_DIM)
        assert names[p + "attn.hook_k"] == names[p + "attn.hook_v"] == (KV_HEADS, HEAD_DIM)
        assert names[p + "mlp.hook_post"] == (FFN,)
        for h in ("hook_resid_pre", "ln1.hook_normalized", "ln1.hook_out", "hook_attn_out", "hook_resid_mid"):
            assert names[p + h] == (D,)
        for h in ("ln2.hook_normalized", "ln2.hook_out", "hook_mlp_out", "hook_resid_post"):
            assert names[p + h] == (D,)
        assert names[p + "ln1.hook_scale"] == names[p + "ln2.hook_scale"] == (1,)
        assert names[p + "attn.hook_attn_scores"] == names[p + "attn.hook_pattern"] == (HEADS, "ctx")
    assert names[FINAL_NORM] == names["ln_final.hook_normalized"] == names["hidden_states.0"] == (D,)
    assert names["ln_final.hook_scale"] == (1,) and names["hook_embed"] == (D,)
    assert names[LOGITS] == (VOCAB,)


def test_every_hook_traces_with_its_advertised_shape(tiny):
    names = tiny.hook_names()
    outs = tiny.trace(IDS, hooks="*")
    for ids, out in zip(IDS, outs):
        assert list(out) == list(names)
        for name, shape in names.items():
            assert out[name].shape == rows_shape(shape, len(ids)), name
            assert out[name].device.type == "cpu" and out[name].dtype == torch.float32
            finite = torch.isfinite(out[name])
            # attention scores are -inf exactly at the future keys; everything else is finite
            assert finite.all() if not name.endswith("hook_attn_scores") else torch.equal(
                finite, torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[:, None, :].expand_as(finite)
            ), name


# --- trace() input errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("texts", "field"),
    [
        ([""], "texts[0]: empty text"),
        (["Hello", ""], "texts[1]: empty text"),
        ("", "texts[0]: empty text"),
        ([], "texts: expected"),
        ([[]], "texts[0]: empty token-id list"),
        (["Hello", [1, 2], []], "texts[2]: empty token-id list"),
        ([[1, 2, 10**6]], "texts[0]: token ids [1000000] outside the vocabulary"),
        ([[1, -1]], "texts[0]: token ids [-1] outside the vocabulary"),
        ([[True, False]], "texts[0]: expected a string or a list of token ids"),
        ([None], "texts[0]: expected a string or a list of token ids"),
        ([torch.tensor([1, 2, 3])], "texts[0]: expected a string or a list of token ids, got Tensor"),  # not 3 prompts
        (None, "texts: expected"),
    ],
)
def test_trace_input_errors_name_the_field(smol, texts, field):
    with pytest.raises(ValueError) as err:
        smol.trace(texts, hooks="blocks.0.hook_resid_post")
    assert str(err.value).startswith(field)


def test_text_input_needs_a_tokenizer(tiny):
    with pytest.raises(ValueError, match=r"^texts\[0\]: this checkpoint has no tokenizer files; pass token-id lists"):
        tiny.trace(["Hello"], hooks=LOGITS)


def test_trace_accepts_one_string_and_mixed_lists(smol):
    one = smol.trace("Hello world", hooks="blocks.0.hook_resid_post")
    ids = smol.tokenizer("Hello world")["input_ids"]
    mixed = smol.trace(["Hello world", ids], hooks="blocks.0.hook_resid_post")
    assert len(one) == 1 and len(mixed) == 2
    assert torch.equal(mixed[0]["blocks.0.hook_resid_post"], mixed[1]["blocks.0.hook_resid_post"])
    assert one[0]["blocks.0.hook_resid_post"].shape == (len(ids), smol.config.hidden_size)


# --- a trace runs only what it needs ------------------------------------------------------------------


@pytest.fixture
def calls(tiny, monkeypatch) -> dict[str, int]:
    """Count the forwards of every decoder layer, the final norm and the unembedding."""
    counts: dict[str, int] = {}

    def count(name: str, module: torch.nn.Module) -> None:
        forward = module.forward

        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return forward(*args, **kwargs)

        monkeypatch.setattr(module, "forward", counted)

    for i, layer in enumerate(tiny.model.model.layers):
        count(f"layer{i}", layer)
    count("norm", tiny.model.model.norm)
    count("lm_head", tiny.model.lm_head)
    return counts


@pytest.mark.parametrize(
    ("hooks", "ran"),
    [
        ("blocks.2.hook_resid_post", ["layer0", "layer1", "layer2"]),
        ("blocks.2.attn.hook_q", ["layer0", "layer1", "layer2"]),
        (["blocks.2.mlp.hook_post", "blocks.0.hook_attn_out"], ["layer0", "layer1", "layer2"]),
        ("blocks.2.hook_resid_pre", ["layer0", "layer1"]),
        ("hidden_states.2", ["layer0", "layer1"]),
        ("hook_embed", []),
        ("hidden_states.0", []),
        ("blocks.3.hook_resid_post", ["layer0", "layer1", "layer2", "layer3"]),
        (FINAL_NORM, ["layer0", "layer1", "layer2", "layer3", "norm"]),
        ("hidden_states.4", ["layer0", "layer1", "layer2", "layer3", "norm"]),
        (LOGITS, ["layer0", "layer1", "layer2", "layer3", "norm", "lm_head"]),
    ],
)
def test_forward_stops_after_the_deepest_hook(tiny, calls, hooks, ran):
    tiny.trace(IDS, hooks=hooks)  # both sequences in one packed forward
    assert calls == {name: 1 for name in ran}


def test_only_requested_taps_are_installed_and_each_fires_once(tiny, monkeypatch):
    """The model's taps dict holds exactly the canonical taps asked for, so no capture code runs elsewhere."""
    seen: list[dict[str, int]] = []
    real_get_context = model_base.get_context

    def spying_get_context():
        ctx = real_get_context()
        if not seen or seen[-1].get("_ctx") != id(ctx):
            record = {"_ctx": id(ctx)}
            seen.append(record)
            for name, tap in list(ctx.taps.items()):
                record[name] = 0

                def counted(x, _name=name, _tap=tap, _record=record):
                    _record[_name] += 1
                    return _tap(x)

                ctx.taps[name] = counted
        return ctx

    monkeypatch.setattr(model_base, "get_context", spying_get_context)
    out = tiny.trace(IDS, hooks=["hidden_states.1", "blocks.0.hook_resid_post", "blocks.1.attn.hook_v"])
    assert len(seen) == 1  # one packed forward for both sequences
    fired = {k: v for k, v in seen[0].items() if k != "_ctx"}
    assert fired == {"blocks.1.hook_resid_pre": 1, "blocks.0.hook_resid_post": 1, "blocks.1.attn.hook_v": 1}
    assert set(out[0]) == {"hidden_states.1", "blocks.0.hook_resid_post", "blocks.1.attn.hook_v"}
    assert torch.equal(out[0]["hidden_states.1"], out[0]["blocks.0.hook_resid_post"])


def test_taps_do_not_change_the_forward(tiny):
    """Capturing is read-only: asking for more hooks leaves every value and the logits as they were."""
    few = tiny.trace(IDS, hooks=[LOGITS])
    many = tiny.trace(IDS, hooks="*")
    for a, b in zip(few, many):
        assert torch.equal(a[LOGITS], b[LOGITS])


def test_no_module_hooks_are_used(tiny):
    """Taps are plain code in the forward (they survive torch.compile and CUDA graphs), not nn.Module hooks."""
    tiny.trace(IDS, hooks="*")
    for module in tiny.model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
