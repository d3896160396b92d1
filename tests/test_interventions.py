"""Steer / Ablate / Patch and on-device readouts, against HF with equivalent forward hooks."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from hf_reference import generate_with_hook

from vlens import LLM, Ablate, Capture, Patch, SamplingParams, Steer

PROMPT = "The weather today is"
D = 576


def _direction(seed: int, norm: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(D, generator=g)
    return v / v.norm() * norm


def test_steer_matches_hf_forward_hook(smol, hf_smol):
    v = _direction(0)
    layer = hf_smol.model.layers[10]

    def add(module, args, output):
        return output + 3.0 * v

    hf_tokens, hf_logits = generate_with_hook(hf_smol, smol.tokenizer, PROMPT, layer, add)
    p = SamplingParams(
        max_tokens=6,
        temperature=0,
        interventions=[Steer("blocks.10.hook_resid_post", v, scale=3.0)],
        capture=Capture(hooks="unembed.hook_out"),
    )
    [out] = smol.generate(PROMPT, p, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_tokens
    assert rel_err(out.activations["unembed.hook_out"], hf_logits) < 1e-4
    [plain] = smol.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, capture=p.capture), use_tqdm=False)
    assert rel_err(plain.activations["unembed.hook_out"][:5], hf_logits[:5]) > 1e-3  # steering did something


def test_ablate_matches_hf_forward_hook(smol, hf_smol):
    d = _direction(1, norm=1.0)
    attn = hf_smol.model.layers[3].self_attn

    def ablate(module, args, output):
        a = output[0]
        return (a - (a @ d)[..., None] * d, *output[1:])

    hf_tokens, hf_logits = generate_with_hook(hf_smol, smol.tokenizer, PROMPT, attn, ablate)
    p = SamplingParams(
        max_tokens=6,
        temperature=0,
        interventions=[Ablate("blocks.3.hook_attn_out", d * 7)],
        capture=Capture(hooks=["unembed.hook_out", "blocks.3.hook_attn_out"]),
    )
    [out] = smol.generate(PROMPT, p, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_tokens
    assert rel_err(out.activations["unembed.hook_out"], hf_logits) < 1e-4
    # The capture at the same tap sees the value after the ablation: nothing left along d.
    assert (out.activations["blocks.3.hook_attn_out"] @ d).abs().max() < 1e-3


def test_patch_equals_hf_patched_run(smol, hf_smol):
    clean, corrupt = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
    corrupt_ids = smol.tokenizer(corrupt)["input_ids"]
    [c] = smol.generate(
        clean,
        SamplingParams(
            max_tokens=1, temperature=0, capture=Capture(hooks="blocks.6.hook_resid_pre", positions="prompt")
        ),
        use_tqdm=False,
    )
    clean_rows = c.activations["blocks.6.hook_resid_pre"]
    pos = [1, 2]  # patch the subject tokens
    values = clean_rows[pos]

    def patch(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        h = h.clone()
        h[0, pos] = values
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    handle = hf_smol.model.layers[6].register_forward_pre_hook(patch, with_kwargs=True)
    try:
        with torch.inference_mode():
            hf_logits = hf_smol(torch.tensor([corrupt_ids])).logits[0]
    finally:
        handle.remove()
    p = SamplingParams(
        max_tokens=1,
        temperature=0,
        interventions=[Patch("blocks.6.hook_resid_pre", values, positions=pos)],
        capture=Capture(hooks="unembed.hook_out", positions="prompt"),
    )
    [out] = smol.generate(corrupt, p, use_tqdm=False)
    assert rel_err(out.activations["unembed.hook_out"], hf_logits) < 1e-4
    assert out.outputs[0].token_ids == [int(hf_logits[-1].argmax())]
    # Reversed list order pairs values with positions the same way.
    p2 = SamplingParams(
        max_tokens=1,
        temperature=0,
        interventions=[Patch("blocks.6.hook_resid_pre", values.flip(0), positions=pos[::-1])],
        capture=Capture(hooks="unembed.hook_out", positions="prompt"),
    )
    [out2] = smol.generate(corrupt, p2, use_tqdm=False)
    assert rel_err(out2.activations["unembed.hook_out"], hf_logits) < 1e-4


def _requests():
    """Every intervention kind in one batch; on SmolLM2 cut to four layers (conftest.smol4): isolation and
    the prefix cache's keys hold for any model."""
    prompts = [
        "The weather today is",
        "My favourite food is",
        "In the year 2050,",
        "Dogs are",
        "Water is",
        "A good book",
    ]
    capture = Capture(hooks=["blocks.3.hook_resid_post", "unembed.hook_out"], positions="all")
    ivs = [
        [Steer("blocks.2.hook_resid_post", _direction(2), scale=2.0)],
        [Ablate("blocks.{1,3}.hook_mlp_out", _direction(3))],
        [
            Steer("blocks.1.hook_resid_mid", _direction(4), positions="generated"),
            Ablate("blocks.1.hook_resid_mid", _direction(4)),
        ],
        [],
        [Patch("blocks.1.hook_resid_post", _direction(5), positions=[0, 1])],
        [Steer("blocks.*.hook_attn_out", _direction(6), scale=0.3, positions=slice(1, None, 2))],
    ]
    params = [SamplingParams(max_tokens=5, temperature=0, capture=capture, interventions=iv) for iv in ivs]
    return prompts, params


def _same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for name in a.activations:
        assert rel_err(a.activations[name], b.activations[name]) < 1e-4, name


def test_mixed_batch_isolation_and_prefix_caching(smol4, smol4_path):
    prompts, params = _requests()
    together = smol4.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        [alone] = smol4.generate(prompt, p, use_tqdm=False)
        _same(out, alone)
    no_cache = LLM(
        model=str(smol4_path), dtype="float32", device="cpu", enable_prefix_caching=False, kv_cache_memory=64 << 20
    )
    for a, b in zip(together, no_cache.generate(prompts, params, use_tqdm=False)):
        _same(a, b)
    # Same prompt, plain then steered then plain: the cache never hands KV across intervention sets.
    small = LLM(model=str(smol4_path), dtype="float32", device="cpu", block_size=2, kv_cache_memory=64 << 20)
    plain = SamplingParams(max_tokens=4, temperature=0, capture=Capture(hooks="unembed.hook_out"))
    steered = SamplingParams(
        max_tokens=4,
        temperature=0,
        capture=plain.capture,
        interventions=[Steer("blocks.2.hook_resid_post", _direction(7, 30.0), positions=[1])],
    )
    first = small.generate(PROMPT, plain, use_tqdm=False)[0]
    s1 = small.generate(PROMPT, steered, use_tqdm=False)[0]
    s2 = no_cache.generate(PROMPT, steered, use_tqdm=False)[0]
    again = small.generate(PROMPT, plain, use_tqdm=False)[0]
    _same(s1, s2)
    _same(first, again)
    assert rel_err(s1.activations["unembed.hook_out"], first.activations["unembed.hook_out"]) > 1e-3


def test_readouts_on_device(smol, hf_smol):
    g = torch.Generator().manual_seed(9)
    W, b = torch.randn(D, 5, generator=g), torch.randn(5, generator=g)
    base = SamplingParams(max_tokens=4, temperature=0, capture=Capture(hooks="blocks.7.hook_resid_post"))
    [ref] = smol.generate(PROMPT, base, use_tqdm=False)
    rows = ref.activations["blocks.7.hook_resid_post"]
    cases = {
        "mean": Capture(hooks="blocks.7.hook_resid_post", reduce="mean"),
        "project": Capture(hooks="blocks.7.hook_resid_post", project=(W, b)),
        "both": Capture(hooks="blocks.7.hook_resid_post", project=W, reduce="mean"),
        "lens": Capture(hooks=["blocks.7.hook_resid_post", "blocks.29.hook_resid_post"], logit_lens=3),
        "mean_last2": Capture(hooks="blocks.7.hook_resid_post", positions=[-2, -1], reduce="mean"),
    }
    outs = dict(
        zip(
            cases,
            smol.generate(
                [PROMPT] * len(cases),
                [SamplingParams(max_tokens=4, temperature=0, capture=c) for c in cases.values()],
                use_tqdm=False,
            ),
        )
    )
    assert outs["mean"].activations["blocks.7.hook_resid_post"].shape == (1, D)
    assert rel_err(outs["mean"].activations["blocks.7.hook_resid_post"], rows.mean(0, keepdim=True)) < 1e-5
    assert outs["project"].activations["blocks.7.hook_resid_post"].shape == (len(rows), 5)
    assert rel_err(outs["project"].activations["blocks.7.hook_resid_post"], rows @ W + b) < 1e-5
    assert rel_err(outs["both"].activations["blocks.7.hook_resid_post"], (rows @ W).mean(0, keepdim=True)) < 1e-5
    assert rel_err(outs["mean_last2"].activations["blocks.7.hook_resid_post"], rows[-2:].mean(0, keepdim=True)) < 1e-5
    lens = outs["lens"]
    assert "blocks.7.hook_resid_post" not in lens.activations
    ids, logprobs = lens.logit_lens["blocks.7.hook_resid_post"]
    assert ids.shape == logprobs.shape == (len(rows), 3) and ids.dtype == torch.long
    with torch.inference_mode():
        expected = hf_smol.lm_head(hf_smol.model.norm(rows)).log_softmax(-1).topk(3)
    assert torch.equal(ids, expected.indices)
    assert rel_err(logprobs, expected.values) < 1e-5
    # Through the last layer the lens is the model's own head: from the last prompt row on, its top-1
    # is each greedy token.
    last_ids, _ = lens.logit_lens["blocks.29.hook_resid_post"]
    assert last_ids[len(ref.prompt_token_ids) - 1 :, 0].tolist() == ref.outputs[0].token_ids


def test_mean_in_another_dtype_is_cast_once(smol):
    """A bfloat16 mean readout is the mean cast once: each step's partial sum was cast to bfloat16 on the
    device, so the mean carried ~3e-3 of rounding that depended on how the rows were split into steps."""
    hook = "blocks.7.hook_resid_post"
    rows = SamplingParams(max_tokens=6, temperature=0, capture=Capture(hooks=hook))
    mean = SamplingParams(max_tokens=6, temperature=0, capture=Capture(hooks=hook, reduce="mean", dtype="bfloat16"))
    full, reduced = smol.generate([PROMPT, PROMPT], [rows, mean], use_tqdm=False)
    expected = full.activations[hook].double().mean(0, keepdim=True).to(torch.bfloat16)
    # The engine sums in float32, this reference in float64: a value on a bfloat16 rounding boundary may
    # round either way (one step, rarely); rounding each step's partial sum moved most of them.
    off = reduced.activations[hook] != expected
    assert int(off.sum()) <= expected.numel() // 100
    step = (expected.float().abs() * 2**-7).clamp(min=2**-126)  # one bfloat16 step at most
    assert bool(((reduced.activations[hook].float() - expected.float()).abs() <= step).all())


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: SamplingParams(interventions=[Steer("blocks.1.hook_resid_post", [1.0] * 10)]), "does not fit"),
        (  # the elements of a row, not its shape: it was read as one
            lambda: SamplingParams(interventions=[Steer("blocks.1.hook_resid_post", torch.ones(2, D // 2))]),
            "does not fit",
        ),
        (  # two rows, transposed
            lambda: SamplingParams(
                interventions=[Patch("blocks.1.hook_resid_post", torch.ones(D, 2), positions=[0, 1])]
            ),
            r"interventions\[0\]\.values",
        ),
        (lambda: Steer("blocks.1.hook_resid_post", [float("nan")] * D), "steer.vector"),
        (lambda: Steer("blocks.1.hook_resid_post", [1.0] * D, scale=1e308), "steer.scale"),  # (inf in float32)
        (lambda: SamplingParams(interventions=[Steer("blocks.77.hook_resid_post", [1.0] * D)]), "blocks.77"),
        (
            lambda: SamplingParams(
                max_tokens=2, interventions=[Steer("blocks.1.hook_resid_post", [1.0] * D, positions=[500])]
            ),
            "out of range",
        ),
        (lambda: Ablate("blocks.1.hook_resid_post", [1.0] * D, positions="last"), "ablate.positions"),
        (lambda: Ablate("blocks.1.hook_resid_post", [0.0] * D), "zero vector"),
        (lambda: Steer("blocks.1.hook_resid_post", [1.0] * D, scale="2"), "steer.scale"),  # (was a TypeError)
        (lambda: Steer("blocks.1.hook_resid_post", [1.0] * D, scale=float("inf")), "steer.scale"),
        (
            lambda: SamplingParams(
                interventions=[Patch("blocks.1.hook_resid_post", torch.ones(3, D), positions="all")]
            ),
            r"interventions\[0\]\.values",
        ),
        (lambda: SamplingParams(interventions=["steer!"]), "interventions\\[0\\]"),
        (lambda: Capture(project=torch.ones(D)), "capture.project"),
        (lambda: Capture(logit_lens=3, reduce="mean"), "capture.logit_lens"),
        (lambda: SamplingParams(capture=Capture(hooks="blocks.1.attn.hook_q", logit_lens=2)), "capture.logit_lens"),
        (  # normed twice, its top tokens were not the logits'
            lambda: SamplingParams(capture=Capture(hooks="hidden_states.*", logit_lens=2)),
            r"capture.logit_lens: .* not \['ln_final.hook_out'\]",
        ),
    ],
)
def test_bad_interventions_are_clear_errors(smol, make, field):
    with pytest.raises(ValueError, match=field):
        params = make()
        if isinstance(params, SamplingParams):
            smol.generate(PROMPT, params, use_tqdm=False)
    assert not smol.engine.has_work()


def test_a_head_steer_takes_one_row_of_its_heads_too(smol):
    """Found in review: the documented [len(heads), d_head] form with one head ([1, d_head]) failed inside
    the binding (a 2-D vector repeated as if it were 1-D); it steers as the [d_head] vector does."""
    vec = torch.randn(smol.config.head_dim, generator=torch.Generator().manual_seed(0)) * 3
    capture = Capture("blocks.8.hook_resid_post", positions="all")
    outs = [
        smol.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, capture=capture,
                                             interventions=[Steer("blocks.6.attn.hook_z", v, heads=[4])]),
                      use_tqdm=False)[0]
        for v in (vec, vec[None, :])
    ]  # fmt: skip
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert torch.equal(outs[0].activations["blocks.8.hook_resid_post"], outs[1].activations["blocks.8.hook_resid_post"])


def test_rows_before_an_intervention_share_the_prefix_cache(smol4_path):
    """A key or value depends on its own row and those before it: a request steered only at its generated rows
    takes its whole prompt's blocks from the prefix cache (and leaves them there for an unsteered one), one
    patched from row 13 on the blocks before it, one steered at every row none; each gets what it gets with no
    prefix cache (tokens, and the logits of the generated rows within 1e-5). In one step, a steered request
    borrows an unsteered one's prompt the same way."""
    cache = dict(model=str(smol4_path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=64 << 20)
    llm, no_cache = LLM(**cache), LLM(**cache, enable_prefix_caching=False)
    texts = ["The weather in the mountains this week will be cold and windy, with snow falling on the high passes "
             "and rain in the valleys below, so travellers should plan for delays.",
             "A short history of the printing press begins in the workshops of Mainz, where a goldsmith named "
             "Gutenberg combined movable metal type with an oil-based ink and a screw press."]  # fmt: skip
    first, second = (ids[:30] for ids in llm.tokenizer(texts)["input_ids"])
    assert len(first) == len(second) == 30
    # (rows a request captures it computes itself: a capture of the generated rows takes the prompt from the cache)
    greedy = dict(max_tokens=4, temperature=0, capture=Capture("unembed.hook_out", positions="generated"))
    steer = Steer("blocks.2.hook_resid_post", _direction(8, 30.0), positions="generated")
    cases = [  # (prompt, interventions, prompt tokens it takes from the prefix cache)
        (first, [], 0),  # computes and publishes the prompt
        (first, [steer], 28),  # every block but the one holding the last prompt token (its logits are needed)
        (first, [Patch("blocks.1.hook_resid_post", _direction(9), positions=[13])], 12),  # blocks ending by row 12
        (first, [Steer("blocks.2.hook_resid_post", _direction(8, 30.0))], 0),
        (second, [steer], 0),  # computes the prompt, steering none of it, and publishes it ...
        (second, [], 28),  # ... for an unsteered request
    ]
    logits = []
    for prompt, interventions, cached in cases:
        params = SamplingParams(**greedy, interventions=interventions)
        before = llm.engine.scheduler.tokens_computed
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.scheduler.tokens_computed - before == len(prompt) - cached + 3, (interventions, cached)
        [want] = no_cache.generate([prompt], params, use_tqdm=False)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        logits.append(out.activations["unembed.hook_out"])
        assert rel_err(logits[-1], want.activations["unembed.hook_out"]) < 1e-5
    assert rel_err(logits[1], logits[0]) > 1e-2 and rel_err(logits[4], logits[5]) > 1e-2  # (the steer acts)
    # In one step, with no prefix cache: the steered request borrows the 30 tokens it shares with the unsteered one,
    # but the last of them, whose logits give the first differing token's (Scheduler._lender)
    prompts = [first + [1000], first + [2000]]
    params = [SamplingParams(**greedy), SamplingParams(**greedy, interventions=[steer])]
    before = no_cache.engine.scheduler.tokens_computed
    together = no_cache.generate(prompts, params, use_tqdm=False)
    assert no_cache.engine.scheduler.tokens_computed - before == 2 * 31 - 29 + 2 * 3
    for prompt, p, out in zip(prompts, params, together):
        [alone] = no_cache.generate([prompt], p, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert rel_err(out.activations["unembed.hook_out"], alone.activations["unembed.hook_out"]) < 1e-5
