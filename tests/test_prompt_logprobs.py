"""Prompt log-probabilities (vLLM's `prompt_logprobs`) against HF's log_softmax at every prompt position:
alone, in a batch with capturing and steering requests, under chunked prefill, preemption and the
prefix cache, prefill-only (max_tokens=0), and once per request with parallel samples."""

from __future__ import annotations

import pytest
import torch

from vlens import LLM, Capture, SamplingParams, Steer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his three daughters.",
]
K = 3
# float32: relative to the logits' scale (the span of the row), since a log-probability is a difference of
# logits. Each is a GEMM's sum over the hidden size, in another order than HF's where shapes differ (a batch's
# rows, chunks of 8 tokens, a prompt's last few behind a prefix another computed): 1e-5 to 1.4e-5 off seen on
# logits near 15, relative error ~1e-6.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def hf_logp(smol, hf_smol) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: its tokens and HF's float32 log_softmax at each position [P, V]."""
    out = []
    for prompt in PROMPTS:
        ids = smol.tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            out.append((ids, hf_smol(torch.tensor([ids])).logits[0].float().log_softmax(-1)))
    return out


def check(output, ids: list[int], logp: torch.Tensor, k: int = K) -> None:
    """Entry p is token p's: None for the first; then its log-probability and the top k, as HF has them."""
    entries = output.prompt_logprobs
    assert output.prompt_token_ids == ids and len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry, row = entries[p], logp[p - 1]
        assert ids[p] in entry
        ranked = sorted((lp.rank, t) for t, lp in entry.items())
        assert [r for r, _ in ranked[:k]] == list(range(1, k + 1)) and len(entry) in (k, k + 1)
        top, band = row.topk(k).values, TOLERANCE * (row.max() - row.min()).item()
        for (rank, t), expected in zip(ranked, top.tolist()):
            assert abs(entry[t].logprob - expected) < band
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < band, (p, t)
        if len(entry) == k + 1:  # the prompt's token, outside the top k: ranked as vLLM ranks it, as HF's row has it
            [(rank, t)] = ranked[k:]
            assert t == ids[p] and row[t] < top[-1] + band
            assert (row > row[t] + band).sum() + 1 <= rank <= (row >= row[t] - band).sum()


def test_alone_and_prefill_only(smol, hf_logp):
    for ids, logp in hf_logp:
        [out] = smol.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K), use_tqdm=False)
        check(out, ids, logp)
        [only] = smol.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=K), use_tqdm=False)
        check(only, ids, logp)
        assert only.outputs[0].token_ids == [] and only.outputs[0].finish_reason == "length"


def test_in_a_mixed_batch(smol, hf_logp):
    vector = torch.randn(576, generator=torch.Generator().manual_seed(0)) * 3
    others = [
        SamplingParams(max_tokens=4, temperature=0, capture=Capture(hooks="blocks.{2,9}.hook_resid_post")),
        SamplingParams(max_tokens=4, temperature=0, interventions=[Steer("blocks.5.hook_resid_post", vector)]),
        SamplingParams(max_tokens=4, temperature=0, capture=Capture(hooks="unembed.hook_out", positions="prompt")),
        SamplingParams(max_tokens=4, temperature=0.8, seed=3),
    ]
    prompts, params = [], []
    for i, (ids, _) in enumerate(hf_logp):
        prompts += [ids, "Hello there, how are you", ids]
        params += [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K), others[i % 4], others[(i + 1) % 4]]
    outs = smol.generate(prompts, params, use_tqdm=False)
    for i, (ids, logp) in enumerate(hf_logp):
        check(outs[3 * i], ids, logp)
        assert outs[3 * i + 1].prompt_logprobs is None and outs[3 * i + 2].prompt_logprobs is None


def test_chunked_prefill_preemption_and_prefix_cache(smol_path, hf_logp):
    # 8-token steps chunk every prompt; 8 blocks of 4 tokens hold the longest request but not three at once.
    llm = LLM(model=str(smol_path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8,
              kv_cache_memory=8 * 2 * 30 * 4 * 3 * 64 * 4)  # fmt: skip
    ids_list = [ids for ids, _ in hf_logp]
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K)
    for out, (ids, logp) in zip(llm.generate(ids_list * 2, params, use_tqdm=False), hf_logp * 2):
        check(out, ids, logp)
    assert llm.engine.scheduler.num_preemptions > 0
    # The prompts' blocks are in the prefix cache now: a request that wants their log-probabilities
    # computes them anyway, one that does not takes them from the cache.
    computed = llm.engine.scheduler.tokens_computed
    [again] = llm.generate([ids_list[2]], params, use_tqdm=False)
    check(again, *hf_logp[2])
    assert llm.engine.scheduler.tokens_computed - computed >= len(ids_list[2])
    computed = llm.engine.scheduler.tokens_computed
    llm.generate([ids_list[2]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert llm.engine.scheduler.tokens_computed - computed <= 4


def test_prompts_sharing_a_prefix_compute_it_once(smol, hf_smol):
    """lm-eval's choices of one question: prompts admitted in one step that start alike compute the shared
    prefix once (full blocks shared, the partial one copied, the log-probabilities handed on, also along a
    chain of borrowers), and each gets what it gets alone and what HF gives. A steered request with the
    same tokens computes its own."""
    context = smol.tokenizer(PROMPTS[2])["input_ids"]  # a full block and a partial one
    assert len(context) == 23
    tails = [smol.tokenizer(t, add_special_tokens=False)["input_ids"] for t in (" The end.", " Yes", " No, never")]
    prompts = [context[:9]] + [context + t for t in tails] + [context[:18] + [1, 2, 3], context, context[:3]]
    with torch.inference_mode():
        hf = [hf_smol(torch.tensor([ids])).logits[0].float().log_softmax(-1) for ids in prompts]
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K)
    steer = Steer("blocks.5.hook_resid_post", torch.randn(576, generator=torch.Generator().manual_seed(1)) * 3)
    plain, steered = SamplingParams(max_tokens=2, temperature=0), SamplingParams(max_tokens=2, temperature=0,
                                                                               interventions=[steer])  # fmt: skip
    computed = smol.engine.scheduler.tokens_computed
    outs = smol.generate(prompts + [context, context], [params] * len(prompts) + [plain, steered], use_tqdm=False)
    # Each takes all but the last of the tokens it shares with one admitted before it: the second 8 from
    # the first; the 22 of the context from the second (so do the plain request and two more), 17 for
    # the one that leaves it mid-block; the steered one takes none, nor does the 3-token one (matched by
    # their first 4 tokens, borrowers are longer). The second step decodes one token each.
    shared = 8 + 22 + 22 + 17 + 22 + 22
    prefill = sum(map(len, prompts)) + 2 * len(context) - shared
    assert smol.engine.scheduler.tokens_computed - computed == prefill + len(outs)
    for out, ids, logp in zip(outs, prompts, hf):
        check(out, ids, logp)  # a borrower's rows run in other GEMM shapes
    for out, ids, p in zip(outs, prompts + [context, context], [params] * len(prompts) + [plain, steered]):
        [alone] = smol.generate([ids], p, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[-2].outputs[0].token_ids != outs[-1].outputs[0].token_ids  # the steer took effect


def test_once_per_request_with_parallel_samples(smol, hf_logp):
    ids, logp = hf_logp[0]
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=11, n=3, prompt_logprobs=1)
    [out] = smol.generate([ids], params, use_tqdm=False)
    assert len(out.outputs) == 3
    check(out, ids, logp, k=1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "prompt_logprobs": 1, "n": 2}, "n"),
    ],
)
def test_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_prefill_only_capture_stops_early_and_stays_apart_in_the_cache(smol_path, hf_smol, hf_logp):
    """A step of prefill-only captures stops after the hook's layer: the same mean as a full forward,
    and its blocks (lacking the deeper layers' KV) are never served to a request that needs them."""
    smol = LLM(
        model=str(smol_path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=64 << 20
    )  # an empty prefix cache
    ids, _ = hf_logp[2]
    hook = "blocks.3.hook_resid_post"
    p = SamplingParams(max_tokens=0, capture=Capture(hooks=hook, positions="prompt", reduce="mean"))
    [alone] = smol.generate([ids], p, use_tqdm=False)  # only prefill-only requests: 4 layers run
    mixed = smol.generate([ids, "Hello"], [p, SamplingParams(max_tokens=3, temperature=0)], use_tqdm=False)
    [traced] = smol.trace([ids], hook)
    mean = traced[hook].double().mean(0).float()
    for out in (alone, mixed[0]):
        assert torch.allclose(out.activations[hook][0], mean, rtol=1e-5, atol=1e-5)
    [greedy] = smol.generate([ids], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    expected = hf_smol.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids) :].tolist()
    assert greedy.outputs[0].token_ids == expected


def test_more_than_the_vocabulary_is_refused_before_it_runs(smol):
    """Found in review: a k above the vocabulary passed validation and failed the step's topk (in the server, a 500
    for every request in that step, and offline an engine that failed every later step too)."""
    for field in ("prompt_logprobs", "logprobs"):
        with pytest.raises(ValueError, match=f"^{field}: "):
            smol.generate("Hi", SamplingParams(max_tokens=1, **{field: smol.config.vocab_size + 1}), use_tqdm=False)
    [out] = smol.generate("Hi", SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and len(out.prompt_logprobs) == len(out.prompt_token_ids)
