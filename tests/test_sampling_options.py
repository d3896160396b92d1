"""OpenAI's and vLLM's sampling options on the device: logit_bias and the presence, frequency and repetition penalties
against a written-out reference over the same logits, leaving every other row of the batch untouched; a prompt
truncated to its last tokens (truncate_prompt_tokens); parallel samples (n, best_of) reproducible and each equal to
the request sent alone with its seed, sharing the prompt's blocks. The engine tests run on SmolLM2 cut to four
layers (conftest.smol4): what they check holds for any model."""

from __future__ import annotations

import pytest
import torch

from vlens import LLM, Capture, SamplingParams
from vlens.capture.bind import RequestTaps
from vlens.engine.llm_engine import LLMEngine, NewRequest
from vlens.engine.sampler import SamplingBatch, sample
from vlens.engine.sequence import Sequence

CPU = torch.device("cpu")


def ON_HOST(name: str, values: torch.Tensor) -> torch.Tensor:  # noqa: N802 - the runner's buffers, on the CPU
    return values

PROMPT = "My favourite colour is blue, and my favourite food is"


def _seq(params: SamplingParams, prompt: list[int], generated: list[int]) -> Sequence:
    seq = Sequence("0", prompt, params, seed=0, stop_ids=frozenset(), taps=RequestTaps())
    seq.token_ids += generated
    return seq


def _reference(row: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """vLLM's order, token by token: bias; repetition over prompt and output; frequency; presence."""
    x = row.clone()
    for token, bias in params.logit_bias.items():
        x[token] += bias
    for token in set(prompt) | set(generated):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(generated):
        x[token] -= params.frequency_penalty * generated.count(token)
        x[token] -= params.presence_penalty
    return x


def test_adjustments_equal_the_reference_and_leave_other_rows_alone():
    g = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab, generator=g) * 4
    cases = [
        (SamplingParams(temperature=0), [1, 2, 3], [4, 4]),  # nothing: untouched
        (SamplingParams(temperature=0, logit_bias={7: 5.5, 39: -100}), [1, 2], [7]),
        (SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=-0.4), [5, 6], [6, 9, 9, 9, 12]),
        (SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={0: 2}), [0, 3, 3, 8], [8, 11]),
        (SamplingParams(temperature=0.7, seed=5, repetition_penalty=0.8, frequency_penalty=1.5), [2], [2, 2, 30]),
    ]
    seqs = [_seq(p, prompt, generated) for p, prompt, generated in cases]
    batch = SamplingBatch.of(seqs, ON_HOST, CPU)
    adjusted = batch.adjust.apply(logits)
    assert torch.equal(adjusted[0], logits[0])
    for i, (params, prompt, generated) in enumerate(cases):
        assert torch.allclose(adjusted[i], _reference(logits[i], params, prompt, generated), atol=1e-6), i
    greedy = sample(logits, batch)
    assert greedy[:4].tolist() == adjusted[:4].argmax(-1).tolist()
    assert SamplingBatch.of(seqs[:1], ON_HOST, CPU).adjust is None  # no option: no work


def test_engine_rows_alone_equal_rows_in_a_batch(smol4):
    penalised = [
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5),
        SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(max_tokens=12, temperature=0.9, seed=4, frequency_penalty=2.0, logit_bias={13: 4.0}),
    ]
    plain = SamplingParams(max_tokens=12, temperature=0)
    prompts = [PROMPT, "1, 2, 3, 4, 5, 6,", "The the the the the", "Hello"]
    params = [*penalised, plain]
    together = smol4.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        [alone] = smol4.generate(prompt, p, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    for prompt, out in zip(prompts[:2], together):  # the penalties do change greedy text
        assert out.outputs[0].token_ids != smol4.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
    forced = smol4.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, logit_bias={42: 100}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [42, 42, 42]


def test_parallel_samples_are_the_seeded_requests_alone(smol4):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=100, n=4, logprobs=0)
    [out] = smol4.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=100 + i, logprobs=0)
        [ref] = smol4.generate(PROMPT, alone, use_tqdm=False)
        assert c.token_ids == ref.outputs[0].token_ids and c.text == ref.outputs[0].text
    [again] = smol4.generate(PROMPT, params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    [unseeded] = smol4.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, n=4), use_tqdm=False)
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) > 1


def test_best_of_returns_the_highest_mean_logprob(smol4):
    [out] = smol4.generate(
        PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, best_of=5), use_tqdm=False
    )
    assert len(out.outputs) == 2 and out.outputs[0].logprobs is None  # ranked, but not asked for
    samples = []
    for i in range(5):
        [ref] = smol4.generate(
            PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, logprobs=0), use_tqdm=False
        )
        c = ref.outputs[0]
        mean = sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)) / len(c.token_ids)
        samples.append((mean, c.token_ids))
    best = [ids for _, ids in sorted(samples, key=lambda s: -s[0])[:2]]
    assert [c.token_ids for c in out.outputs] == best


def test_samples_share_the_prompt_blocks(smol4_path):
    llm = LLM(model=str(smol4_path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=64 << 20)
    ids = llm.tokenizer(PROMPT * 3)["input_ids"]
    [out] = llm.generate(
        [ids], SamplingParams(max_tokens=5, temperature=1.0, seed=1, n=4, ignore_eos=True), use_tqdm=False
    )
    # Sample 0 computes the prompt; the others only its last, partial block (and its last token).
    last_block = len(ids) - 4 * ((len(ids) - 1) // 4)
    assert llm.engine.scheduler.tokens_computed == len(ids) + 3 * last_block + 4 * (5 - 1)
    assert all(len(c.token_ids) == 5 for c in out.outputs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"temperature": "0"}, "temperature"),  # (these three were TypeErrors naming no field)
        ({"top_p": None}, "top_p"),
        ({"seed": "a"}, "seed"),
        ({"top_k": True}, "top_k"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # (max_tokens is 16)
        ({"min_tokens": -1}, "min_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ],
)
def test_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_fails_before_running(smol4):
    with pytest.raises(ValueError, match=r"^logit_bias: token ids \[49152\]"):
        smol4.generate(
            ["fine", "also fine"], [SamplingParams(max_tokens=2), SamplingParams(logit_bias={49152: 1})], use_tqdm=False
        )
    assert not smol4.engine.has_work()


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(smol4):
    ids = smol4.tokenizer(PROMPT)["input_ids"]
    options = dict(max_tokens=4, temperature=0, prompt_logprobs=1, capture=Capture("blocks.1.hook_resid_post"))
    [cut] = smol4.generate(PROMPT, SamplingParams(truncate_prompt_tokens=5, **options), use_tqdm=False)
    [ref] = smol4.generate([ids[-5:]], SamplingParams(**options), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-5:] and cut.prompt == PROMPT  # (its text kept, as vLLM keeps it)
    assert cut.outputs[0].token_ids == ref.outputs[0].token_ids
    assert torch.equal(cut.activations["blocks.1.hook_resid_post"], ref.activations["blocks.1.hook_resid_post"])
    assert [e and {t: p.logprob for t, p in e.items()} for e in cut.prompt_logprobs] == \
        [e and {t: p.logprob for t, p in e.items()} for e in ref.prompt_logprobs]  # fmt: skip
    whole = SamplingParams(truncate_prompt_tokens=len(ids), **options)
    assert smol4.generate(PROMPT, whole, use_tqdm=False)[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="^truncate_prompt_tokens: 3 would cut a prompt with images"):
        LLMEngine._truncated(NewRequest(ids, SamplingParams(truncate_prompt_tokens=3), images=object()))


def _rows(n: int, **options) -> list[Sequence]:
    """n sequences of one request's options, with seeds 0 .. n - 1 (as the engine derives them)."""
    seqs = [_seq(SamplingParams(**options), [1, 2], []) for _ in range(n)]
    for i, seq in enumerate(seqs):
        seq.seed = i
    return seqs


def test_seeded_samples_survive_the_float_noise_of_another_batch():
    """The same request in another batch gets logits that differ by float noise (~1e-6); its seeded
    sample must not move (inverting the CDF moved 4 of 929 soak requests: tail boundaries are closer)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 49152, generator=g) * 3
    noisy = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=g))
    for options in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}):
        batch = SamplingBatch.of(_rows(256, **options), ON_HOST, CPU)
        first = sample(logits, batch)
        assert torch.equal(first, sample(noisy, batch)), options
        assert len(set(first.tolist())) > 200  # and the draws are spread, not stuck on the argmax


@pytest.mark.parametrize(
    "options",
    [{"temperature": 0.8}, {"temperature": 1.0, "top_k": 3}, {"temperature": 1.0, "top_p": 0.7},
     {"temperature": 1.0, "min_p": 0.2}],
)  # fmt: skip
def test_samples_follow_the_filtered_softmax(options):
    """20,000 seeds over one row: token frequencies within 0.012 (about 4 standard deviations) of the
    softmax of the tempered logits, renormalised over the tokens the filter keeps."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
    n = 20_000
    batch = SamplingBatch.of(_rows(n, **options), ON_HOST, CPU)
    counts = torch.bincount(sample(logits.expand(n, -1), batch), minlength=len(logits)).float() / n
    probs = (logits / options["temperature"]).softmax(-1)
    keep = torch.ones(len(logits), dtype=torch.bool)
    if "top_k" in options:
        keep[options["top_k"] :] = False  # the logits are in descending order
    if "top_p" in options:
        keep = (probs.cumsum(-1) - probs) < options["top_p"]
    if "min_p" in options:
        keep = probs >= options["min_p"] * probs.max()
    expected = torch.where(keep, probs, 0) / probs[keep].sum()
    assert (counts - expected).abs().max() <= 0.012, (counts, expected)


def test_extreme_settings_sample_as_their_limits():
    """Found in review: a top_p that rounds to 0 in float32 cut every token and a temperature of 1e-45
    overflowed the logits (garbage tokens, no error); a top_k past int64 failed the step. Now the best
    token always stays, a temperature below 1e-5 is greedy (vLLM's rule), and a top_k past every
    vocabulary cuts nothing."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 512, generator=g)
    best = logits.argmax(-1)
    for options in ({"top_p": 1e-50}, {"temperature": 1e-45}, {"temperature": 1e-45, "top_p": 0.5}):
        assert torch.equal(sample(logits, SamplingBatch.of(_rows(8, **options), ON_HOST, CPU)), best), options
    assert SamplingParams(top_k=2**63).top_k == SamplingParams(top_k=-1).top_k == 0
    wide = sample(logits, SamplingBatch.of(_rows(8, temperature=1.0, top_k=100_000), ON_HOST, CPU))
    assert torch.equal(wide, sample(logits, SamplingBatch.of(_rows(8, temperature=1.0), ON_HOST, CPU)))
