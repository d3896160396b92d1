"""TransformerLens's calls (vlens.HookedLM): cached values equal HF on texts of different lengths (pads
masked, never compared), stop_at_layer, pos_slice, hook functions that ablate a head or steer, and
errors that name what is wrong."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build, transformer_lens_gpt2
from hf_reference import hf_taps, same
from transformers import Gemma2Config, GPT2Config, LlamaConfig

import vlens.hooked as utils
from vlens import ActivationCache, HookedLM
from vlens.capture.names import PATTERNS

TEXTS = ["The capital of France is", "Hello", "Once upon a time, in a small village by the sea, there lived"]


@pytest.fixture(scope="module")
def hooked(smol_path) -> HookedLM:
    return HookedLM(str(smol_path), dtype="float32", device="cpu")


def _each_text(cache: ActivationCache, name: str, lengths: list[int]):
    """The real (unpadded) rows of each text, after checking the pads are zeros (patterns: per query
    position, as HF's references are, from TransformerLens's [batch, heads, query_pos, key_pos])."""
    value = cache[name].transpose(1, 2) if name.endswith(PATTERNS) else cache[name]
    for i, n in enumerate(lengths):
        assert not value[i, n:].any(), (name, i)  # never computed on a pad (a zero row, scores too)
        yield value[i, :n]


def test_cache_equals_hf_on_texts_of_different_lengths(hooked, hf_smol):
    names = "blocks.{0,15,29}.*"
    logits, cache = hooked.run_with_cache(TEXTS, names_filter=names)
    ids = [hooked.to_tokens(t)[0].tolist() for t in TEXTS]
    lengths = [len(i) for i in ids]
    assert cache.mask.tolist() == [[j < n for j in range(max(lengths))] for n in lengths]
    refs = [hf_taps(hf_smol, i, (0, 15, 29)) for i in ids]
    assert {n.split(".")[1] for n in cache} == {"0", "15", "29"} and len(cache) == 3 * 18
    for name in cache:
        for ref, got in zip(refs, _each_text(cache, name, lengths)):
            n = len(ref[name])  # attention patterns are as wide as the longest text: the rest is no key
            assert same(got[..., :n] if name.endswith(PATTERNS) else got, ref[name], 1e-5), name
    for ref, got in zip(refs, _each_text({"logits": logits}, "logits", lengths)):  # type: ignore[arg-type]
        assert rel_err(got, ref["unembed.hook_out"]) <= 1e-5
    assert torch.equal(cache["resid_post", 15], cache["blocks.15.hook_resid_post"])
    assert torch.equal(cache["q", 0], cache["blocks.0.attn.hook_q"])
    assert torch.equal(cache["scale", 29, "ln2"], cache["blocks.29.ln2.hook_scale"])


OTHER_FAMILIES = pytest.mark.parametrize(
    "config",
    [
        lambda: Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                             attn_logit_softcapping=30.0, final_logit_softcapping=20.0),
        lambda: GPT2Config(vocab_size=COMMON["vocab_size"], n_embd=64, n_layer=3, n_head=4, n_positions=128),
    ],
    ids=["gemma2", "gpt2"],
)  # fmt: skip


@OTHER_FAMILIES
def test_other_families_with_a_mask(config, tmp_path):
    path = build(config(), tmp_path, "model")
    hooked = HookedLM(path, dtype="float32", device="cpu")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [13, 5]
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 13), generator=g)
    mask = torch.arange(13)[None, :] < torch.tensor(lengths)[:, None]
    _, cache = hooked.run_with_cache(tokens, attention_mask=mask)
    refs = [hf_taps(hf, tokens[i, :n].tolist(), range(3)) for i, n in enumerate(lengths)]
    compared = 0
    for name in cache:
        for ref, got in zip(refs, _each_text(cache, name, lengths)):
            if name in ref:
                n = len(ref[name])
                assert same(got[..., :n] if name.endswith(PATTERNS) else got, ref[name], 1e-5), name
                compared += 1
    assert compared == 2 * len(cache)  # every cached hook has an HF counterpart


@OTHER_FAMILIES
def test_generate_with_hooks_over_the_kv_cache_in_other_families(config, tmp_path):
    """A hook that treats every position alike gives the same steps with the KV cache as without it, past a
    sliding window (Gemma 2: window 6, soft-capping) and with learned positions (GPT-2): tokens, and what the
    hook sees at each step's last position (≤ 1e-5)."""
    hooked = HookedLM(build(config(), tmp_path, "model"), dtype="float32", device="cpu", block_size=4)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    out, seen = {}, {True: [], False: []}
    for cached in (True, False):

        def scale(resid, hook, seen=seen[cached]):
            seen.append(resid[:, -1].clone())
            return resid * 1.5

        with hooked.hooks([("blocks.1.hook_resid_post", scale)]):
            out[cached] = hooked.generate(tokens, max_new_tokens=8, do_sample=False, stop_at_eos=False,
                                          use_past_kv_cache=cached, return_type="tokens", verbose=False)  # fmt: skip
    assert out[True].tolist() == out[False].tolist() and len(seen[True]) == len(seen[False]) == 8
    for a, b in zip(seen[True], seen[False]):
        assert rel_err(a, b) <= 1e-5


def test_stop_at_layer_and_pos_slice(hooked, hf_smol):
    resid, cache = hooked.run_with_cache(TEXTS[:2], names_filter="blocks.*.hook_resid_pre", stop_at_layer=4)
    ids = [hooked.to_tokens(t)[0].tolist() for t in TEXTS[:2]]
    refs = [hf_taps(hf_smol, i, range(4)) for i in ids]
    assert sorted(cache) == [f"blocks.{i}.hook_resid_pre" for i in range(5)]  # nothing past the stop
    for i, (ref, n) in enumerate(zip(refs, map(len, ids))):
        assert rel_err(resid[i, :n], ref["hidden_states.4"]) <= 1e-5
    _, full = hooked.run_with_cache(TEXTS[:2], names_filter="blocks.3.hook_resid_post")
    _, last = hooked.run_with_cache(TEXTS[:2], names_filter="blocks.3.hook_resid_post", pos_slice=-1)
    _, first_two = hooked.run_with_cache(TEXTS[:2], names_filter="blocks.3.hook_resid_post", pos_slice=slice(0, 2))
    name = "blocks.3.hook_resid_post"
    for i, n in enumerate(map(len, ids)):
        assert torch.equal(last[name][i], full[name][i, n - 1])  # each text's own last position
        assert torch.equal(first_two[name][i, : min(n, 2)], full[name][i, : min(n, 2)])
    assert last[name].shape == (2, hooked.cfg.hidden_size)


def test_stop_at_layer_counts_from_the_end_as_transformer_lens_does(hooked):
    """`blocks[:stop_at_layer]`: -1 runs all layers but the last (it failed with a KeyError on blocks.-1)."""
    n = hooked.cfg.num_layers
    resid, cache = hooked.run_with_cache(TEXTS[:2], names_filter="blocks.*.hook_resid_pre", stop_at_layer=-1)
    expected, _ = hooked.run_with_cache(TEXTS[:2], names_filter="hook_embed", stop_at_layer=n - 1)
    assert torch.equal(resid, expected) and sorted(cache) == sorted(f"blocks.{i}.hook_resid_pre" for i in range(n))
    assert torch.equal(hooked.run_with_hooks(TEXTS[:2], stop_at_layer=-1), expected)
    assert torch.equal(hooked(TEXTS[:2], stop_at_layer=-1), expected)  # the forward takes it too, as TransformerLens's
    with pytest.raises(ValueError, match=rf"stop_at_layer: {-n - 1} is not an int in -{n}..{n}"):
        hooked.run_with_cache("hi", stop_at_layer=-n - 1)


def test_patterns_come_in_transformer_lens_layout(hooked, hf_smol):
    """cache["pattern", L][b, h] is head h's [query_pos, key_pos] matrix, as TransformerLens caches it (it was
    [query_pos, heads, key_pos]: a ported notebook read position h as if it were a head)."""
    names = "blocks.3.attn.hook_{pattern,attn_scores}"
    _, cache = hooked.run_with_cache(TEXTS[:2], names_filter=names)
    _, last = hooked.run_with_cache(TEXTS[:2], names_filter=names, pos_slice=-1)
    lengths = [len(hooked.to_tokens(t)[0]) for t in TEXTS[:2]]
    heads, width = hooked.cfg.num_heads, max(lengths)
    for i, text in enumerate(TEXTS[:2]):
        ref = hf_taps(hf_smol, hooked.to_tokens(text)[0].tolist(), (3,))
        n = lengths[i]
        for kind in ("pattern", "attn_scores"):
            assert cache[kind, 3].shape == (2, heads, width, width)
            expected = ref[f"blocks.3.attn.hook_{kind}"]  # [query_pos, heads, key_pos]
            assert same(cache[kind, 3][i, :, :n, :n], expected.transpose(0, 1), 1e-5), kind
            assert last[kind, 3].shape == (2, heads, width)  # TransformerLens's int pos_slice: [batch, heads, key_pos]
            assert same(last[kind, 3][i, :, :n], expected[-1], 1e-5), kind


def test_accumulated_resid_and_stack(hooked):
    _, cache = hooked.run_with_cache(TEXTS[:2], names_filter=["blocks.*.hook_resid_pre", "blocks.29.hook_resid_post",
                                                              "ln_final.hook_out"])  # fmt: skip
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert stack.shape[0] == 31 and labels[0] == "0_pre" and labels[-1] == "final_post"
    assert torch.equal(stack[5], cache["resid_pre", 5])
    normed = cache.accumulated_resid(apply_ln=True)
    assert rel_err(normed[-1], cache["ln_final.hook_out"]) <= 1e-6  # the model's own final norm
    assert torch.equal(cache.stack_activation("resid_pre")[7], cache["resid_pre", 7])
    # TransformerLens's logit-lens call, verbatim (pos_slice was an unexpected keyword)
    last, labels = cache.accumulated_resid(layer=-1, incl_mid=False, pos_slice=-1, apply_ln=True, return_labels=True)
    lengths = cache.mask.sum(1).tolist()
    assert last.shape == (31, 2, hooked.cfg.hidden_size) and labels[-1] == "final_post"
    for i, n in enumerate(lengths):
        assert torch.equal(last[:, i], normed[:, i, n - 1])


NAMES = [("k6",), ("scale4ln1",), ("attn", 3), ("key", 2), ("attn_logits", 2), ("scale",), ("normalized",), ("pre5",),
         ("mlp_out", 1), ("resid_pre", 0), ("post", 3), ("embed",), ("z", 0, "a"), ("resid_post", 2, "b"),
         ("scale", 2, "ln2"), ("q", 1, "attention"), ("blocks.3.hook_resid_pre",)]  # fmt: skip


@pytest.mark.parametrize("args", NAMES)
def test_get_act_name_is_transformer_lens_rule_for_rule(args):
    """The short forms ("k6"), aliases ("attn" is the pattern) and the final norm's "scale" were other names."""
    from transformer_lens.utilities.components_utils import get_act_name

    assert utils.get_act_name(*args) == get_act_name(*args)


def test_cache_keys_as_transformer_lens_takes_them(hooked):
    _, cache = hooked.run_with_cache("Hello there", names_filter=["blocks.*.hook_resid_post", "blocks.3.attn.hook_*"])
    n = hooked.cfg.num_layers
    assert torch.equal(cache["resid_post", -1], cache[f"blocks.{n - 1}.hook_resid_post"])  # negative from the end
    assert torch.equal(cache["attn", 3], cache["blocks.3.attn.hook_pattern"])
    assert torch.equal(cache["k3"], cache["blocks.3.attn.hook_k"])
    # TransformerLens's post-rotary names read vlens's hook_q / hook_k (after rotary, as HF's): a KeyError before
    assert torch.equal(cache["rot_q", 3], cache["q", 3]) and torch.equal(cache["blocks.3.attn.hook_rot_k"], cache["k", 3])


def test_run_with_hooks_ablates_a_head_and_steers_like_hf(hooked, hf_smol):
    layer, head, d_head = 3, 2, hooked.cfg.head_dim
    vector = torch.randn(hooked.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    seen = []

    def ablate(z, hook):
        seen.append((hook.name, hook.layer(), tuple(z.shape)))
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    def steer(resid, hook):
        return resid + vector

    hooks = [(f"blocks.{layer}.attn.hook_z", ablate), ("blocks.5.hook_resid_post", steer)]
    logits = hooked.run_with_hooks(TEXTS[:2], fwd_hooks=hooks)
    ids = [hooked.to_tokens(t)[0].tolist() for t in TEXTS[:2]]
    assert seen == [(f"blocks.{layer}.attn.hook_z", layer, (2, max(map(len, ids)), hooked.cfg.num_heads, d_head))]
    blocks = hf_smol.model.layers
    handles = [
        blocks[layer].self_attn.o_proj.register_forward_pre_hook(
            lambda m, a: (a[0].index_fill(-1, torch.arange(head * d_head, (head + 1) * d_head), 0.0),)
        ),
        blocks[5].register_forward_hook(lambda m, a, o: (o[0] + vector, *o[1:]) if isinstance(o, tuple) else o + vector),
    ]
    try:
        with torch.inference_mode():
            refs = [hf_smol(torch.tensor([i])).logits[0] for i in ids]
    finally:
        for h in handles:
            h.remove()
    for i, (ref, n) in enumerate(zip(refs, map(len, ids))):
        assert rel_err(logits[i, :n], ref) <= 1e-4
    with hooked.hooks(fwd_hooks=hooks):  # the same through the context manager
        assert torch.equal(hooked(TEXTS[:2]), logits)
    assert not torch.equal(hooked(TEXTS[:2]), logits)  # and gone after it


def test_config_answers_to_transformer_lens_names(hooked, hf_smol):
    """`for layer in range(model.cfg.n_layers)` opens many notebooks: it failed with an AttributeError."""
    hf, cfg = hf_smol.config, hooked.cfg
    ported = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab,
              cfg.n_ctx)  # fmt: skip
    assert ported == (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
                      hf.head_dim, hf.intermediate_size, hf.vocab_size, hf.max_position_embeddings)  # fmt: skip
    assert cfg.device == torch.device("cpu")  # (`tokens.to(model.cfg.device)`)


def test_tokens_and_loss(hooked, hf_smol):
    tokens = hooked.to_tokens(TEXTS[:2])
    assert tokens.shape == (2, len(hooked.to_tokens(TEXTS[0])[0]))
    assert hooked.to_string(tokens[0]) == TEXTS[0]
    assert "".join(hooked.to_str_tokens(TEXTS[0])) == TEXTS[0]
    ids = hooked.to_tokens(TEXTS[0])[0]
    loss = hooked(TEXTS[0], return_type="loss")
    with torch.inference_mode():
        ref = hf_smol(ids[None], labels=ids[None]).loss
    assert rel_err(loss, ref) <= 1e-5
    # TransformerLens's BOS on texts, in the forwards too (a TypeError before): the tokens of to_tokens(prepend_bos=True)
    with_bos = hooked.to_tokens(TEXTS[:2], prepend_bos=True)
    assert with_bos[:, 0].tolist() == [hooked.tokenizer.bos_token_id] * 2
    assert torch.equal(hooked(TEXTS[:2], prepend_bos=True), hooked(with_bos, attention_mask=_bos_mask(hooked, TEXTS[:2])))
    _, cache = hooked.run_with_cache(TEXTS[0], prepend_bos=True, names_filter="hook_embed")
    assert cache["hook_embed"].shape[1] == len(with_bos[0])


def _bos_mask(hooked: HookedLM, texts: list[str]) -> torch.Tensor:
    """Which positions of to_tokens(texts, prepend_bos=True) are tokens."""
    lengths = [len(hooked.to_tokens(t, prepend_bos=True)[0]) for t in texts]
    return torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]


def _left_padded(hooked: HookedLM, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as TransformerLens users build it for generation: left-padded tokens and their attention mask."""
    ids = [hooked.to_tokens(t)[0] for t in texts]
    width = max(map(len, ids))
    tokens = torch.full((len(ids), width), hooked.tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        tokens[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return tokens, mask


def test_a_left_padded_batch_comes_back_in_its_own_layout(hooked, hf_smol):
    """With an attention mask, every output sits where the mask puts each text: `logits[:, -1]` of a left-padded
    batch is each text's last position. It came back right-padded, so a shorter text's `logits[i, -1]` was a
    row of zeros (and pos_slice, the loss and the patterns' keys counted from the wrong end)."""
    texts = TEXTS[:2]
    tokens, mask = _left_padded(hooked, texts)
    names = ["blocks.3.hook_resid_post", "blocks.3.attn.hook_pattern"]
    logits, cache = hooked.run_with_cache(tokens, names_filter=names, attention_mask=mask)
    _, last = hooked.run_with_cache(tokens, names_filter=names[0], attention_mask=mask, pos_slice=-1)
    assert torch.equal(cache.mask, mask.bool())
    width = tokens.shape[1]
    for i, text in enumerate(texts):
        ids = hooked.to_tokens(text)[0]
        real = slice(width - len(ids), None)
        ref = hf_taps(hf_smol, ids.tolist(), (3,))
        with torch.inference_mode():
            hf_logits = hf_smol(ids[None]).logits[0]
        assert rel_err(logits[i, real], hf_logits) <= 1e-5 and not logits[i, : width - len(ids)].any()
        assert rel_err(logits[i, -1], hf_logits[-1]) <= 1e-5
        assert same(cache["resid_post", 3][i, real], ref[names[0]], 1e-5)
        assert same(last[names[0]][i], ref[names[0]][-1], 1e-5)
        pattern = cache["pattern", 3][i]  # [heads, query_pos, key_pos]: keys where their tokens are, too
        assert same(pattern[:, real, real], ref[names[1]].transpose(0, 1), 1e-5)
        assert not pattern[:, :, : width - len(ids)].any()
        per_token = hooked(tokens, return_type="loss", loss_per_token=True, attention_mask=mask)[i]
        losses = torch.nn.functional.cross_entropy(hf_logits[:-1], ids[1:], reduction="none")
        assert rel_err(per_token[width - len(ids) :], losses) <= 1e-5 and not per_token[: width - len(ids)].any()


def test_loss_per_token_as_transformer_lens_gives_it(hooked, hf_smol):
    """loss_per_token=True: [batch, positions - 1], entry p the loss of the token after position p, zero past
    each text's end (a TypeError before)."""
    per_token = hooked(TEXTS[:2], return_type="loss", loss_per_token=True)
    _, also = hooked.run_with_cache(TEXTS[:2], return_type="loss", loss_per_token=True, names_filter="hook_embed")
    lengths = [len(hooked.to_tokens(t)[0]) for t in TEXTS[:2]]
    assert per_token.shape == (2, max(lengths) - 1)
    for i, (text, n) in enumerate(zip(TEXTS[:2], lengths)):
        ids = hooked.to_tokens(text)[0]
        with torch.inference_mode():
            ref = torch.nn.functional.cross_entropy(hf_smol(ids[None]).logits[0, :-1], ids[1:], reduction="none")
        assert rel_err(per_token[i, : n - 1], ref) <= 1e-5 and not per_token[i, n - 1 :].any()
    mean = hooked(TEXTS[:2], return_type="loss")
    assert rel_err(mean, per_token.sum() / (sum(lengths) - 2)) <= 1e-6


def test_remove_batch_dim(hooked):
    """run_with_cache(remove_batch_dim=True) and cache.remove_batch_dim(), as in TransformerLens: a cache of one
    text without its batch dimension, the methods' results too (a TypeError / AttributeError before)."""
    names = ["blocks.*.hook_resid_pre", "blocks.29.hook_resid_post"]
    logits, batched = hooked.run_with_cache(TEXTS[0], names_filter=names)
    out, cache = hooked.run_with_cache(TEXTS[0], names_filter=names, remove_batch_dim=True)
    assert torch.equal(out, logits) and out.dim() == 3  # the output keeps its batch dimension
    assert torch.equal(cache["resid_pre", 3], batched["resid_pre", 3][0])
    assert torch.equal(cache.accumulated_resid(apply_ln=True), batched.accumulated_resid(apply_ln=True)[:, 0])
    assert torch.equal(cache.accumulated_resid(pos_slice=-1), batched.accumulated_resid(pos_slice=-1)[:, 0])
    assert torch.equal(cache.stack_activation("resid_pre"), batched.stack_activation("resid_pre")[:, 0])
    assert torch.equal(batched.remove_batch_dim()["resid_pre", 3], cache["resid_pre", 3])
    with pytest.raises(ValueError, match="remove_batch_dim: the batch holds 2 texts"):
        hooked.run_with_cache(TEXTS[:2], remove_batch_dim=True)


def test_generate_with_a_hook_at_the_logits_samples_what_it_returns(hooked):
    """A hook at unembed.hook_out in generate sees every position a step feeds ([batch, positions, vocab], then
    [batch, 1, vocab] over the KV cache), as at every other hook, and the step samples from what it returns."""
    prompts = ["Once upon a time there was a", "The capital of France is"]
    for cached in (True, False):
        seen = []

        def favour(logits, hook):
            seen.append(tuple(logits.shape[:2]))
            return logits.index_add(-1, torch.tensor([42]), torch.full((*logits.shape[:2], 1), 1e4))

        with hooked.hooks([("unembed.hook_out", favour)]):
            tokens = hooked.generate(prompts, max_new_tokens=3, do_sample=False, return_type="tokens",
                                     use_past_kv_cache=cached, verbose=False)  # fmt: skip
        width = tokens.shape[1] - 3
        assert tokens[:, -3:].tolist() == [[42] * 3] * 2
        assert seen == ([(2, width), (2, 1), (2, 1)] if cached else [(2, width), (2, width + 1), (2, width + 2)])


def test_generate_with_hooks_equals_hf_with_the_same_edit(hooked, hf_smol):
    """generate inside `with model.hooks(...)` runs the hook at every step (it had no generate): greedy tokens
    equal HF's generate with the head zeroed in a forward hook, texts of different lengths in one batch; the
    tokens come back as TransformerLens gives them, prompts left-padded, a text that stopped early filled with
    EOS. Sampling draws the engine's noise either way, so a hook that changes nothing changes no sample."""
    prompts = [hooked.tokenizer.apply_chat_template([{"role": "user", "content": "Say only yes."}], tokenize=False,
                                                    add_generation_prompt=True), "Once upon a time there was a"]  # fmt: skip

    def zero_head(z, hook):
        z[:, :, 4] = 0.0

    with hooked.hooks([("blocks.2.attn.hook_z", zero_head)]):
        tokens = hooked.generate(prompts, max_new_tokens=10, do_sample=False, return_type="tokens", verbose=False)
        text = hooked.generate(prompts[1], max_new_tokens=10, do_sample=False, verbose=False)
    d_head = hooked.cfg.head_dim
    handle = hf_smol.model.layers[2].self_attn.o_proj.register_forward_pre_hook(
        lambda m, a: (a[0].index_fill(-1, torch.arange(4 * d_head, 5 * d_head), 0.0),)
    )
    try:
        refs = []
        for p in prompts:
            ids = hooked.to_tokens(p)[0]
            with torch.inference_mode():
                refs.append(hf_smol.generate(ids[None], max_new_tokens=10, do_sample=False)[0].tolist())
    finally:
        handle.remove()
    eos, pad = hooked.tokenizer.eos_token_id, hooked.tokenizer.pad_token_id
    new = [ref[len(hooked.to_tokens(p)[0]) :] for ref, p in zip(refs, prompts)]
    assert new[0][-1] == eos and len(new[0]) < len(new[1]) == 10  # the chat prompt stops early
    rows = [ref + [eos] * (10 - len(n)) for ref, n in zip(refs, new)]
    width = max(map(len, rows))
    assert tokens.tolist() == [[pad] * (width - len(row)) + row for row in rows]
    assert text == hooked.tokenizer.decode(refs[1])
    torch.manual_seed(0)
    plain = hooked.generate(prompts, max_new_tokens=8, verbose=False)
    with hooked.hooks([("blocks.2.attn.hook_z", lambda z, hook: None)]):
        torch.manual_seed(0)
        assert hooked.generate(prompts, max_new_tokens=8, verbose=False) == plain


def test_added_hooks_last_until_reset_and_permanent_ones_until_asked(hooked):
    """add_hook's hooks run in the order added (prepend: first) in every forward, generate's too; reset_hooks
    removes them but the permanent ones, which outlast a `with` block too; a backward hook is refused by name."""
    tokens, calls = hooked.to_tokens("The capital of France is"), []

    def note(tag):
        return lambda value, hook: calls.append((tag, hook.name, value.shape[1]))

    hooked.add_hook("blocks.1.hook_resid_post", note("a"))
    hooked.add_hook("blocks.1.hook_resid_post", note("first"), prepend=True)
    with hooked.hooks([("blocks.1.hook_resid_post", note("with"))]):
        hooked.add_hook(lambda name: name == "blocks.0.hook_resid_post", note("kept"), is_permanent=True)
        hooked(tokens)
    n = tokens.shape[1]
    assert calls == [("kept", "blocks.0.hook_resid_post", n), ("first", "blocks.1.hook_resid_post", n),
                     ("a", "blocks.1.hook_resid_post", n), ("with", "blocks.1.hook_resid_post", n)]  # fmt: skip
    calls.clear()
    hooked.generate(tokens, max_new_tokens=2, do_sample=False, stop_at_eos=False, verbose=False)  # (over the KV cache: the new token alone)
    assert [c[0] for c in calls] == ["kept", "first", "a"] * 2 and [c[2] for c in calls] == [n] * 3 + [1] * 3
    calls.clear()
    hooked.reset_hooks()
    hooked(tokens)
    assert [c[0] for c in calls] == ["kept"]
    calls.clear()
    hooked.reset_hooks(including_permanent=True)
    hooked(tokens)
    assert calls == []
    with pytest.raises(ValueError, match=r"^dir: 'both' is not one of fwd, bwd"):
        hooked.add_hook("blocks.0.hook_resid_post", note("x"), dir="both")


def test_run_with_cache_can_give_a_plain_dict(hooked):
    """TransformerLens's return_cache_object=False: the tensors by name (one text's without the batch dimension
    under remove_batch_dim), the same as the cache object's."""
    names = ["blocks.2.hook_resid_post", "blocks.1.attn.hook_pattern"]
    for remove in (False, True):
        logits, plain = hooked.run_with_cache(TEXTS[0], names_filter=names, remove_batch_dim=remove,
                                              return_cache_object=False)  # fmt: skip
        _, cache = hooked.run_with_cache(TEXTS[0], names_filter=names, remove_batch_dim=remove)
        assert type(plain) is dict and plain.keys() == set(names)
        assert all(torch.equal(plain[name], cache[name]) for name in names)
        assert plain[names[0]].dim() == 3 - remove and logits.dim() == 3


def test_a_hook_point_adds_and_removes_its_own_hooks(hooked):
    """TransformerLens's `model.hook_dict[name].add_hook(fn)` and `.remove_hooks()`: the model's hooks at that
    name (a glob's hook stays; a permanent one stays unless asked)."""
    zero = lambda value, hook: value * 0.0  # noqa: E731
    want = hooked.run_with_hooks(TEXTS[0], fwd_hooks=[("blocks.3.hook_mlp_out", zero)])
    plain = hooked(TEXTS[0])
    point, seen = hooked.hook_dict["blocks.3.hook_mlp_out"], []
    point.add_hook(zero)
    point.add_perma_hook(lambda value, hook: seen.append(hook.name))
    hooked.add_hook("blocks.*.hook_mlp_out", lambda value, hook: None)
    try:
        assert torch.equal(hooked(TEXTS[0]), want) and not torch.allclose(want, plain)
        point.remove_hooks()
        assert torch.equal(hooked(TEXTS[0]), plain) and seen == ["blocks.3.hook_mlp_out"] * 2
        assert [h.where for h in hooked._hooks] == ["blocks.3.hook_mlp_out", "blocks.*.hook_mlp_out"]
        point.remove_hooks(including_permanent=True)
        assert [h.where for h in hooked._hooks] == ["blocks.*.hook_mlp_out"]
    finally:
        hooked.reset_hooks(including_permanent=True)


def test_hook_points_sit_where_transformer_lens_s_module_tree_has_them(tmp_path):
    """`model.blocks[L].attn.hook_z`, `.ln1.hook_scale`, `.mlp.hook_post`, `.hook_resid_pre`, `model.hook_embed`:
    the hook points (add_hook on them gives TransformerLens's logits with the same hooks added the same way), also
    as a names_filter; beside the weights of the same objects; unknown names are AttributeErrors listing what is
    there."""
    path, reference = transformer_lens_gpt2(tmp_path)
    model = HookedLM(path, dtype="float32", device="cpu")
    tokens = torch.tensor([[5, 17, 99, 230, 3, 41, 7]])
    halve = lambda value, hook: value * 0.5  # noqa: E731
    with torch.no_grad():
        for m in (model, reference):
            for point in (m.blocks[1].attn.hook_z, m.blocks[0].ln1.hook_scale, m.blocks[2].mlp.hook_post,
                          m.blocks[1].hook_resid_pre, m.hook_embed):  # fmt: skip
                point.add_hook(halve)
        try:
            got, want = model(tokens), reference(tokens)
        finally:
            model.reset_hooks(), reference.reset_hooks()
        assert rel_err(got, want) <= 1e-5 and rel_err(got, model(tokens)) > 1e-2
        _, cache = model.run_with_cache(tokens, names_filter=model.blocks[2].ln2.hook_normalized)
    assert list(cache) == ["blocks.2.ln2.hook_normalized"] and model.blocks[2].ln2.hook_normalized.layer() == 2
    assert model.blocks[1].attn.W_O.shape == (4, 16, 64) and model.blocks[1].mlp.W_out.shape == (256, 64)
    listed = r"^blocks\.0\.attn\.hook_zz: no hook point of this model; under blocks\.0\.attn\.: hook_attn_scores, hook_k"
    with pytest.raises(AttributeError, match=listed):
        model.blocks[0].attn.hook_zz
    with pytest.raises(AttributeError, match=r"^hook_pos_embed: no hook point of this model"):
        HookedLM(build(LlamaConfig(**COMMON), tmp_path, "llama"), dtype="float32", device="cpu").hook_pos_embed


def test_token_positions_and_hook_names_as_transformer_lens_gives_them(hooked):
    """get_token_position (TransformerLens's own method, run on this model, gives the same), to_single_str_token,
    hook_dict; a token that is not there, or a batch, named."""
    from transformer_lens import HookedTransformer

    prompt = "When Mary and John went to the store, John gave a drink to"
    for token, mode in ((" John", "first"), (" John", "last"), (hooked.to_single_token(" Mary"), "first")):
        want = HookedTransformer.get_token_position(hooked, token, prompt, mode=mode)
        assert hooked.get_token_position(token, prompt, mode=mode) == want
    assert hooked.get_token_position(" John", hooked.to_tokens(prompt), mode="last") == 9
    left, right = (hooked.to_tokens(["Hi", prompt], padding_side=side) for side in ("left", "right"))
    assert left[0, -1] == right[0, 0] == hooked.to_tokens("Hi")[0, 0] and torch.equal(left[1], right[1])
    assert left[0, 0] == right[0, -1] == hooked.tokenizer.pad_token_id
    assert hooked.to_single_str_token(hooked.to_single_token(" Mary")) == " Mary"
    assert "blocks.3.attn.hook_z" in hooked.hook_dict and hooked.hook_dict["blocks.3.attn.hook_z"].layer() == 3
    assert not any(name.startswith("hidden_states.") for name in hooked.hook_dict)
    with pytest.raises(ValueError, match=r"^single_token: ' Paris' \(id \d+\) does not occur in the input"):
        hooked.get_token_position(" Paris", prompt)
    with pytest.raises(ValueError, match=r"^input: token ids of one text"):
        hooked.get_token_position(" John", hooked.to_tokens([prompt, prompt]))


def test_to_str_tokens_takes_what_transformer_lens_takes(hooked):
    """Tokens as a tensor ([positions] or a batch of one) or a list of texts: it failed with "only one element
    tensors can be converted to Python scalars" on `model.to_str_tokens(tokens[0])`."""
    tokens = hooked.to_tokens(TEXTS[0])
    expected = hooked.to_str_tokens(TEXTS[0])
    assert hooked.to_str_tokens(tokens[0]) == hooked.to_str_tokens(tokens) == hooked.to_str_tokens(tokens[0].tolist()) == expected
    assert hooked.to_str_tokens(TEXTS[:2]) == [expected, hooked.to_str_tokens(TEXTS[1])]


def test_bad_input_names_the_problem(hooked):
    with pytest.raises(ValueError, match="blocks.0.hook_nope"):
        hooked.run_with_cache("hi", names_filter="blocks.0.hook_nope")
    with pytest.raises(ValueError, match=r"fwd_hooks: the function at blocks.1.hook_resid_post returned \(3,\)"):
        hooked.run_with_hooks("hi", fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: torch.zeros(3))])
    with pytest.raises(ValueError, match="return_type"):
        hooked("hi", return_type="probs")
    tokens = hooked.to_tokens(TEXTS[:2])
    with pytest.raises(ValueError, match=r"attention_mask: shape \(2, 3\) differs from the tokens' \(2, 5\)"):
        hooked(tokens, attention_mask=torch.ones(2, 3))  # an IndexError inside the indexing before
    with pytest.raises(ValueError, match="attention_mask: goes with a .* token tensor"):
        hooked(TEXTS[:2], attention_mask=torch.ones(2, 5))  # ignored before
    with pytest.raises(ValueError, match=r"pos_slice: 3 is outside text 1's 1 positions"):
        hooked.run_with_cache(TEXTS[:2], pos_slice=3)  # an IndexError before
    with pytest.raises(ValueError, match=r"input\[0\]: token ids \[99999\] outside the vocabulary"):
        hooked(torch.tensor([[1, 99999]]))  # an IndexError inside the embedding before
    with pytest.raises(ValueError, match="freq_penalty"):
        hooked.generate("hi", freq_penalty=1.0, verbose=False)
    with pytest.raises(ValueError, match="max_new_tokens: 0 is not allowed"):
        hooked.generate("hi", max_new_tokens=0, verbose=False)
    # a hook at no hook of the model, or one that is no function: said when added, and nothing is left in force
    # (added, it failed every later forward)
    with pytest.raises(ValueError, match=r"^name: 'blocks.99.hook_resid_pre' matches no hook of this model"):
        hooked.add_hook("blocks.99.hook_resid_pre", lambda x, hook: None, "bwd")
    with pytest.raises(ValueError, match=r"^bwd_hooks: 'blocks.0.hook_resid_pree' matches no hook .* closest valid "
                                         r"names: blocks.0.hook_resid_pre"):  # fmt: skip
        with hooked.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: None)],
                          bwd_hooks=[("blocks.0.hook_resid_pree", lambda x, hook: None)]):  # fmt: skip
            pass
    with pytest.raises(ValueError, match=r"^fwd_hooks: the hook at 'blocks.0.hook_resid_pre' is str, not a function"):
        hooked.run_with_hooks("hi", fwd_hooks=[("blocks.0.hook_resid_pre", "steer")])
    assert hooked._hooks == [] and hooked("hi").shape[0] == 1


@pytest.mark.parametrize("where", ["blocks.1.attn.hook_pattern", "blocks.*.attn.hook_attn_scores",
                                   lambda name: name.endswith("hook_pattern")])  # fmt: skip
def test_hooks_at_attention_patterns_read_them_and_are_refused_a_replacement(hooked, where):
    """Patterns are computed beside the fused attention, so a forward hook there reads them, after the forward
    ([batch, heads, query_pos, key_pos], layer by layer: what run_with_cache gives, which the parity tests hold
    to HF's); one that returns a tensor could change nothing and is refused by name, as is one in generate (and
    such hooks used to fail mid-forward with an AttributeError)."""
    seen = {}
    logits = hooked.run_with_hooks(TEXTS[:2], fwd_hooks=[(where, lambda x, hook: seen.__setitem__(hook.name, x.clone()))])
    _, cache = hooked.run_with_cache(TEXTS[:2], names_filter=list(seen))
    assert seen and list(seen) == sorted(seen, key=lambda n: int(n.split(".")[1]))
    assert all(torch.equal(seen[n], cache[n]) for n in seen) and torch.equal(logits, hooked(TEXTS[:2]))
    with pytest.raises(ValueError, match=r"^fwd_hooks: the function at blocks\.\d+\.attn\.hook_\w+ returned a tensor"):
        hooked.run_with_hooks("hi", fwd_hooks=[(where, lambda x, hook: x)])
    refused = r"fwd_hooks: blocks\.\d+\.attn\.hook_(pattern|attn_scores).* cannot be hooked in generate"
    with hooked.hooks([(where, lambda x, hook: None)]), pytest.raises(ValueError, match=refused):
        hooked.generate("hi", max_new_tokens=2, verbose=False)
    assert hooked("hi").shape[:2] == (1, len(hooked.to_tokens("hi")[0]))  # nothing left armed


def test_texts_longer_than_the_model_are_refused_by_name(tmp_path):
    """Past n_positions a learned position embedding has no row: trace and HookedLM failed with an IndexError
    inside the forward."""
    path = build(GPT2Config(vocab_size=COMMON["vocab_size"], n_embd=64, n_layer=2, n_head=4, n_positions=16),
                 tmp_path, "gpt2")  # fmt: skip
    hooked = HookedLM.from_pretrained_no_processing(path, dtype="float32", device="cpu")  # (TransformerLens's call)
    tokens = torch.arange(1, 18)[None]
    with pytest.raises(ValueError, match=r"^texts\[1\]: 17 tokens exceed this model's length, max_model_len=16"):
        hooked.llm.trace([[1, 2], tokens[0].tolist()], hooks="hook_embed")
    with pytest.raises(ValueError, match=r"^input\[0\]: 17 tokens"):
        hooked.run_with_cache(tokens)
    assert hooked(tokens[:, :16]).shape == (1, 16, COMMON["vocab_size"])  # the longest that fits


# A TransformerLens notebook cell; porting it to vlens changes only the two lines in braces.
NOTEBOOK = """
{imports}
{load}
tokens = torch.tensor([[5, 17, 99, 230, 3, 41, 7, 8], [60, 2, 140, 33, 290, 11, 12, 13]])
logits, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_resid_post"))
resid = cache["resid_post", 1]

def ablate_head(z, hook):
    z[:, :, 2, :] = 0.0
    return z

ablated = model.run_with_hooks(tokens, fwd_hooks=[(utils.get_act_name("z", 1), ablate_head)])
model.add_hook(utils.get_act_name("z", 1), ablate_head)
ablated_until_reset = model(tokens)
model.reset_hooks()
after_reset = model(tokens)
"""


def test_a_transformer_lens_notebook_ports_by_its_import_and_loading_lines(tmp_path):
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import AutoModelForCausalLM

    path = build(GPT2Config(vocab_size=COMMON["vocab_size"], n_embd=64, n_layer=3, n_head=4, n_positions=128),
                 tmp_path, "gpt2")  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    original = {"hf": hf, "convert_gpt2_weights": convert_gpt2_weights, "torch": torch}
    exec(NOTEBOOK.format(
        imports="from transformer_lens import HookedTransformer, HookedTransformerConfig\nimport transformer_lens.utils as utils",
        load="cfg = HookedTransformerConfig(n_layers=3, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=300, n_ctx=128, "
             "act_fn='gelu_new', normalization_type='LN')\nmodel = HookedTransformer(cfg)\n"
             "model.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)",
    ), original)  # fmt: skip
    ported = {"torch": torch}
    exec(NOTEBOOK.format(
        imports="from vlens import HookedLM as HookedTransformer\nimport vlens.hooked as utils",
        load=f"model = HookedTransformer({path!r}, dtype='float32', device='cpu')",
    ), ported)  # fmt: skip
    tokens = ported["tokens"]
    handle = hf.transformer.h[1].attn.c_proj.register_forward_pre_hook(
        lambda m, a: (a[0].index_fill(-1, torch.arange(32, 48), 0.0),)
    )
    with torch.inference_mode():
        ablated_ref = hf(tokens).logits
    handle.remove()
    with torch.inference_mode():
        out = hf(tokens, output_hidden_states=True)
    for run in (original, ported):  # the same cell gives HF's numbers under TransformerLens and under vlens
        assert rel_err(run["logits"], out.logits) <= 1e-5
        assert rel_err(run["resid"], out.hidden_states[2]) <= 1e-5
        assert rel_err(run["ablated"], ablated_ref) <= 1e-4
        assert torch.equal(run["ablated_until_reset"], run["ablated"]) and torch.equal(run["after_reset"], run["logits"])
    assert rel_err(ported["logits"], out.logits) < rel_err(original["logits"], out.logits) + 1e-6


@pytest.mark.parametrize("use_past_kv_cache", [True, False])
def test_generate_with_hooks_sees_what_transformer_lens_gives_its_hooks(tmp_path, smol_path, use_past_kv_cache):
    """A hook that reads the residual stream and steers `resid[:, -1]` sees at each step what TransformerLens gives
    it, on the same weights: with the KV cache the prompts and then [batch, 1, d_model] of the new tokens (the
    steered keys and values staying in the cache the later steps read), without it every position at every step.
    The values agree at each step (≤ 1e-4: twelve steps of TransformerLens's own numerics), and so do the greedy
    tokens; the KV blocks lent for the call are back afterwards. (TransformerLens is given a tokenizer, any whose
    pad id the prompts avoid: without one, its cached generate shifts the new token's position by the cache's
    length, in transformer-lens 3.9.)"""
    from transformers import AutoTokenizer

    path, reference = transformer_lens_gpt2(tmp_path)
    reference.set_tokenizer(AutoTokenizer.from_pretrained(smol_path), default_padding_side="left")
    hooked = HookedLM(path, dtype="float32", device="cpu", block_size=4)
    direction = torch.randn(64, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[5, 17, 99, 230, 3, 41, 7], [60, 22, 140, 33, 290, 11, 12]])
    seen, out = {}, {}
    for model in (reference, hooked):
        seen[model] = []

        def steer_last(resid, hook, seen=seen[model]):
            seen.append(resid.clone())
            resid[:, -1] += direction

        with model.hooks([("blocks.1.hook_resid_pre", steer_last)]):
            out[model] = model.generate(tokens, max_new_tokens=12, do_sample=False, stop_at_eos=False,
                                        use_past_kv_cache=use_past_kv_cache, return_type="tokens", verbose=False)  # fmt: skip
    assert out[hooked].tolist() == out[reference].tolist()
    widths = [x.shape[1] for x in seen[hooked]]
    assert widths == ([7] + [1] * 11 if use_past_kv_cache else list(range(7, 19)))
    for ours, theirs in zip(seen[hooked], seen[reference], strict=True):
        assert ours.shape == theirs.shape and rel_err(ours, theirs) <= 1e-4
    blocks = hooked.llm.engine.blocks
    assert len(blocks.free) == len(blocks.blocks)


def test_generate_with_hooks_names_a_kv_cache_too_full_and_takes_nothing(tmp_path):
    """Blocks too few for the texts' cache: a ValueError naming use_past_kv_cache and what would fit, before any
    step and with no block taken; without the cache the same call runs. A hook that raises mid-way: its error,
    and the lent blocks back."""
    path = build(GPT2Config(vocab_size=COMMON["vocab_size"], n_embd=64, n_layer=2, n_head=4, n_positions=64),
                 tmp_path, "gpt2")  # fmt: skip
    hooked = HookedLM(path, dtype="float32", device="cpu", block_size=4)
    blocks = hooked.llm.engine.blocks
    held = blocks.lend([(len(blocks.free) - 3) * 4])  # 3 blocks left: 12 tokens
    tokens = torch.tensor([[5, 17, 99], [60, 22, 140]])
    with hooked.hooks([("blocks.0.hook_resid_post", lambda resid, hook: None)]):
        with pytest.raises(ValueError, match=r"^use_past_kv_cache: 2 texts of up to 8 tokens need 4 KV cache blocks of 4 "
                                             r"tokens and 3 are free; .* use_past_kv_cache=False"):  # fmt: skip
            hooked.generate(tokens, max_new_tokens=5, verbose=False)
        assert len(blocks.free) == 3
        out = hooked.generate(tokens, max_new_tokens=5, use_past_kv_cache=False, stop_at_eos=False, verbose=False)
    assert out.shape == (2, 8)
    for table in held:
        blocks.give_back(table)
    assert len(blocks.free) == len(blocks.blocks)
    calls = []

    def fails_at_the_third_step(resid, hook):
        calls.append(resid.shape[1])
        if len(calls) == 3:
            raise RuntimeError("a hook's own error")

    with hooked.hooks([("blocks.0.hook_resid_post", fails_at_the_third_step)]):
        with pytest.raises(RuntimeError, match="a hook's own error"):
            hooked.generate(tokens, max_new_tokens=5, verbose=False)
    assert calls == [3, 1, 1] and len(blocks.free) == len(blocks.blocks)  # (the lent blocks are back)


@pytest.mark.parametrize("answer", [" Paris", "Paris is", [" Paris", " Lyon", " London"]])
def test_test_prompt_prints_what_transformer_lens_prints(hooked, capsys, answer):
    """utils.test_prompt of a ported notebook: the lines TransformerLens's own test_prompt prints for the same
    model (one answer token, an answer of two tokens without its space, several answers)."""
    from transformer_lens import utils as theirs

    theirs.test_prompt("The capital of France is", answer, hooked, top_k=4)
    want = capsys.readouterr().out
    utils.test_prompt("The capital of France is", answer, hooked, top_k=4)
    got = capsys.readouterr().out
    assert got == want and "Rank: " in got and got.count("Top ") == 4 * (2 if answer == "Paris is" else 1)


def test_transformer_lens_s_head_detector_and_induction_loss_run_on_a_hooked_lm(hooked, hf_smol):
    """TransformerLens's head_detector.detect_head and evals.induction_loss read `cfg.dtype` and
    `cfg.default_prepend_bos` (SmolLM2's tokenizer puts no BOS first) besides the cache and the loss: on a
    HookedLM they give what they give with HF's own attention patterns (detect_head takes a cache) and logits."""
    from transformer_lens import evals
    from transformer_lens import utils as tl_utils
    from transformer_lens.head_detector import detect_head

    assert (hooked.cfg.dtype, hooked.cfg.default_prepend_bos) == (torch.float32, False)
    text = "The cat sat on the mat. The cat sat on the mat."
    tokens = hooked.to_tokens(text)
    implementation = hf_smol.config._attn_implementation
    hf_smol.set_attn_implementation("eager")  # (the attention that returns its patterns)
    try:
        with torch.no_grad():
            attentions = hf_smol(tokens, output_attentions=True).attentions
    finally:
        hf_smol.set_attn_implementation(implementation)
    hf_cache = {("pattern", layer, "attn"): a[0] for layer, a in enumerate(attentions)}
    for kind in ("previous_token_head", "induction_head", "duplicate_token_head"):
        ours, theirs = detect_head(hooked, text, kind), detect_head(hooked, text, kind, cache=hf_cache)
        assert ours.shape == (30, 9) and rel_err(ours, theirs) <= 1e-5, kind
    torch.manual_seed(0)
    loss = evals.induction_loss(hooked, batch_size=2, subseq_len=20, device="cpu")
    torch.manual_seed(0)
    repeated = torch.randint(100, 20000, (2, 20)).repeat(1, 2)  # (induction_loss's tokens, drawn the same way)
    with torch.no_grad():
        per_token = tl_utils.lm_cross_entropy_loss(hf_smol(repeated).logits, repeated, per_token=True)
    assert abs(loss.item() - per_token[:, 21:].mean().item()) <= 1e-5 * loss.item()


def test_the_cache_lives_where_the_model_does_unless_asked(hooked):
    """As in TransformerLens: outputs and cache on the model's device (where captures, which reach the host,
    are moved back: on CUDA `cache[...] @ model.W_U` must not mix devices); `device=` puts the cache, its
    gradients too, elsewhere ("meta" here, the one other device a CPU has)."""
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"]
    logits, cache = hooked.run_with_cache(TEXTS[:2], names_filter=names)
    assert {logits.device, *(cache[n].device for n in names)} == {hooked.cfg.device}
    loss, moved = hooked.run_with_cache(TEXTS[:2], names_filter=names, return_type="loss", incl_bwd=True, device="meta")
    assert loss.device == hooked.cfg.device and sorted(moved) == sorted([*names, *(f"{n}_grad" for n in names)])
    assert {moved[n].device.type for n in moved} == {"meta"}


def test_a_dropped_hooked_model_is_freed_at_once(smol_path):
    """An engine moves the objects alive at its start out of the garbage collector's walks (gc.freeze), and a frozen
    object is freed only when nothing refers to it: a HookedLM whose hook points referred back to it (a cycle, which
    only the collector frees) held its weights and KV cache for the process's life once dropped. Its hook points refer
    to it weakly: dropping it frees its model at once, hooks used or not."""
    import gc
    import weakref

    first = HookedLM(str(smol_path), dtype="float32", device="cpu", kv_cache_memory=64 << 20)
    with first.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x)]):
        first.generate("Hello", max_new_tokens=2, verbose=False)  # (its engine starts: the heap frozen)
    point = first.hook_dict["blocks.0.hook_resid_post"]
    assert point.model is first and gc.get_freeze_count() > 0
    runner = weakref.ref(first.llm.runner)
    del first
    assert runner() is None and point.model is None
