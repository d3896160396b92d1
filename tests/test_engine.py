"""The engine against HF generate, and its promises: isolation in mixed batches, preemption, chunked
prefill and prefix caching that never change a token or a captured row."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import rel_err

from vlens import LLM, Capture, SamplingParams, Steer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "Water boils at",
]
LAYERS = (0, 14, 29)


@pytest.fixture(scope="module")
def hf_runs(hf_smol, smol):
    """HF greedy generation of each prompt alone: new tokens and per-step hidden states."""
    runs = []
    for prompt in PROMPTS:
        ids = smol.tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            g = hf_smol.generate(
                ids, max_new_tokens=8, do_sample=False, output_hidden_states=True, return_dict_in_generate=True
            )
        steps = g.hidden_states  # step 0: all prompt positions; later steps: the one fed-back token
        hidden = {i: torch.cat([s[i][0] for s in steps]) for i in range(len(steps[0]))}
        runs.append((g.sequences[0, ids.shape[1] :].tolist(), hidden))
    return runs


def _capture_params(**kw) -> SamplingParams:
    hooks = [f"hidden_states.{i}" for i in range(31)] + [f"blocks.{i}.hook_resid_post" for i in LAYERS]
    return SamplingParams(max_tokens=8, temperature=0, capture=Capture(hooks=hooks, positions="all"), **kw)


def _check_against_hf(out, hf_tokens, hf_hidden):
    assert out.outputs[0].token_ids == hf_tokens
    rows = len(out.prompt_token_ids) + len(hf_tokens) - 1
    assert out.activation_positions.tolist() == list(range(rows))
    for i in range(31):
        assert rel_err(out.activations[f"hidden_states.{i}"], hf_hidden[i]) < 1e-4
    for layer in LAYERS[:-1]:  # HF has no raw output of the last layer
        assert rel_err(out.activations[f"blocks.{layer}.hook_resid_post"], hf_hidden[layer + 1]) < 1e-4


def test_greedy_matches_hf_one_at_a_time(smol, hf_runs):
    for prompt, (tokens, hidden) in zip(PROMPTS, hf_runs):
        [out] = smol.generate(prompt, _capture_params(), use_tqdm=False)
        _check_against_hf(out, tokens, hidden)


def test_greedy_matches_hf_batched(smol, hf_runs):
    outs = smol.generate(PROMPTS, _capture_params(), use_tqdm=False)
    for out, (tokens, hidden) in zip(outs, hf_runs):
        _check_against_hf(out, tokens, hidden)
        assert out.outputs[0].text == smol.tokenizer.decode(tokens, skip_special_tokens=True)


# The engine's promises below hold for any model: they run on SmolLM2 cut to four layers (conftest.smol4),
# a seventh of the work of the whole model, for the many generations they compare.
MIXED_SPECS = [
    None,
    Capture(hooks="blocks.3.hook_resid_post", positions="all"),
    Capture(hooks=["blocks.{1,3}.hook_attn_out", "blocks.2.attn.hook_z"], positions="generated"),
    Capture(hooks="blocks.3.mlp.hook_post", positions="last"),
    Capture(hooks="hidden_states.4", positions=[0, 2, -1, -3]),
    Capture(hooks=["blocks.0.ln1.hook_normalized", "unembed.hook_out"], positions="prompt"),
    Capture(hooks="blocks.1.attn.hook_k", positions=slice(1, None, 2), dtype="bfloat16"),
    Capture(hooks="blocks.2.hook_resid_mid", positions="all", exclude_token_ids=[28]),
]


def _mixed_requests(n: int):
    words = "the quick brown fox jumps over a lazy dog while seven small cats watch".split()  # noqa: SIM905
    prompts = [" ".join(words[: 2 + (i * 5) % 12]) + f" {i}" for i in range(n)]
    params = [
        SamplingParams(max_tokens=3 + i % 5, temperature=0, capture=MIXED_SPECS[i % len(MIXED_SPECS)]) for i in range(n)
    ]
    return prompts, params


def _same(a, b):
    """Same tokens, same rows; values equal up to float32 noise. Batch shape changes GEMM summation
    order, and a few tokens are ill-conditioned (SmolLM2 has logit rows where even HF float32 is 4e-4
    off a float64 run), so the bound is the issue's generation tolerance, 1e-4, over each tensor."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.activations.keys() == b.activations.keys()
    if a.activation_positions is not None or b.activation_positions is not None:
        assert torch.equal(a.activation_positions, b.activation_positions)
    for name in a.activations:
        assert a.activations[name].shape == b.activations[name].shape, name
        assert a.activations[name].dtype == b.activations[name].dtype
        assert rel_err(a.activations[name].float(), b.activations[name].float()) < 1e-4, name


@pytest.fixture(scope="module")
def mixed_batch(smol4):
    """32 mixed requests generated together: each compared with itself alone, and their rows counted."""
    prompts, params = _mixed_requests(32)
    return prompts, params, smol4.generate(prompts, params, use_tqdm=False)


def test_isolation_mixed_batch(smol4, mixed_batch):
    prompts, params, together = mixed_batch
    for prompt, p, out in zip(prompts, params, together):
        [alone] = smol4.generate(prompt, p, use_tqdm=False)
        _same(out, alone)
        if p.capture is None:
            assert out.activations == {} and out.activation_positions is None


def _raw(positions):
    """A parsed Positions as the plain Python value it was written as."""
    if positions.kind == "list":
        return list(positions.indices)
    if positions.kind == "slice":
        return slice(positions.start, positions.stop, positions.step)
    return positions.kind


def test_row_counts_follow_the_spec(mixed_batch):
    _, params, outs = mixed_batch
    for out, p in zip(outs, params):
        P, G = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        rows = P + G - 1
        seq = out.prompt_token_ids + out.outputs[0].token_ids
        spec = _raw(p.capture.positions) if p.capture else None
        expected = {
            None: None,
            "all": list(range(rows)),
            "generated": list(range(P, rows)),
            "last": [rows - 1],
            "prompt": list(range(P)),
        }.get(spec if isinstance(spec, str) or spec is None else "other", "other")
        if isinstance(spec, list):
            expected = sorted({q if q >= 0 else rows + q for q in spec})
        elif isinstance(spec, slice):
            expected = list(range(rows))[spec]
        if p.capture is not None and p.capture.exclude_token_ids:
            expected = [q for q in expected if seq[q] not in p.capture.exclude_token_ids]
        if expected is None:
            assert out.activation_positions is None
            continue
        assert out.activation_positions.tolist() == expected
        for name, t in out.activations.items():
            assert t.shape[0] == len(expected), name


def test_preemption_chunked_prefill_prefix_caching(smol4_path):
    prompts, params = _mixed_requests(16)
    shared = "Here is a long shared system prompt that many requests start with, word for word. " * 3
    prompts = [shared + p for p in prompts]
    roomy = LLM(
        model=str(smol4_path), dtype="float32", device="cpu", enable_prefix_caching=False, kv_cache_memory=64 << 20
    )
    baseline = roomy.generate(prompts, params, use_tqdm=False)  # nothing preempted, nothing cached
    # 24 blocks of 8 tokens cannot hold 16 sequences of ~60 tokens; 32-token steps chunk every prompt.
    tight = LLM(
        model=str(smol4_path),
        dtype="float32",
        device="cpu",
        block_size=8,
        max_num_batched_tokens=32,
        kv_cache_memory=24 * 2 * 4 * 8 * 3 * 64 * 4,
    )
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(outs, baseline):
        _same(a, b)
    # The same prompts again: prefix blocks now come from the cache, captured rows must not shrink.
    again = tight.generate(prompts, params, use_tqdm=False)
    for a, b in zip(again, baseline):
        _same(a, b)


def test_prefix_cache_is_used_and_capture_still_complete(smol4_path):
    llm = LLM(model=str(smol4_path), dtype="float32", device="cpu", block_size=4, kv_cache_memory=64 << 20)
    prompt = "A prefix that is long enough to fill several cache blocks of four tokens each, and more."
    first = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    cached_before = len(llm.engine.blocks.cached)
    assert cached_before >= 4
    p = SamplingParams(max_tokens=2, temperature=0, capture=Capture(hooks="blocks.1.hook_resid_post"))
    [out] = llm.generate(prompt, p, use_tqdm=False)
    assert out.outputs[0].token_ids == first[0].outputs[0].token_ids
    assert out.activation_positions.tolist() == list(range(len(out.prompt_token_ids) + 1))
    [ref] = llm.trace([out.prompt_token_ids + out.outputs[0].token_ids[:1]], "blocks.1.hook_resid_post")
    assert rel_err(out.activations["blocks.1.hook_resid_post"], ref["blocks.1.hook_resid_post"]) < 1e-5
    # A request without capture reuses the cached prefix: only its last block(s) get computed.
    llm.engine.blocks.cached.clear()
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    filled = len(llm.engine.blocks.cached)
    [again] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids
    assert len(llm.engine.blocks.cached) == filled  # nothing new: the prefix came from the cache


def test_capturing_prompts_borrow_a_shared_prefix_but_not_rows_they_capture(smol4_path):
    """Prompts behind one system prompt, admitted in one step, compute it once also when they capture or
    steer, as a prefix-cache hit would let them: a capture of generated rows or of the last row borrows it,
    a capture of every row computes its own, a steered request borrows only from one steered alike. Every
    token and captured row is what the request gets alone."""
    llm = LLM(model=str(smol4_path), dtype="float32", device="cpu", block_size=4, enable_prefix_caching=False,
              kv_cache_memory=64 << 20)  # fmt: skip
    system = llm.tokenizer("You are a careful assistant who answers in one short sentence, politely.")["input_ids"]
    prompts = [system + [1000 + i, 7, 8] for i in range(6)]  # the first token after the system prompt differs
    steer = Steer("blocks.1.hook_resid_post", torch.randn(576, generator=torch.Generator().manual_seed(0)) * 4)
    greedy = dict(max_tokens=3, temperature=0)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, capture=Capture(["blocks.1.hook_resid_post", "blocks.2.attn.hook_z"], positions="generated")),
        SamplingParams(**greedy, capture=Capture("blocks.3.attn.hook_pattern", positions="last")),
        SamplingParams(**greedy, capture=Capture("blocks.0.hook_resid_post")),  # every row
        SamplingParams(**greedy, interventions=[steer]),
        SamplingParams(**greedy, interventions=[steer], capture=Capture("blocks.2.hook_resid_post", positions="generated")),
    ]  # fmt: skip
    computed = llm.engine.scheduler.tokens_computed
    outs = llm.generate(prompts, params, use_tqdm=False)
    borrowed = (len(system) - 1) * 3  # requests 1 and 2 (from 0) and 5 (from 4); 3 and 4 compute their own
    assert llm.engine.scheduler.tokens_computed - computed == sum(map(len, prompts)) - borrowed + 2 * len(prompts)
    for out, prompt, p in zip(outs, prompts, params):
        [alone] = llm.generate([prompt], p, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        if p.capture is not None:
            assert out.activation_positions.tolist() == alone.activation_positions.tolist()
        for name, value in alone.activations.items():
            assert rel_err(out.activations[name], value) < 1e-5, name
    assert outs[4].outputs[0].token_ids != outs[0].outputs[0].token_ids  # the steer took effect


def test_seed_gives_same_sample_whatever_the_batch(smol4):
    p = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    [alone] = smol4.generate("My favourite colour is", p, use_tqdm=False)
    others = [SamplingParams(max_tokens=5, temperature=0.8, seed=i) for i in range(5)]
    mixed = smol4.generate(
        ["Hello there", "My favourite colour is", "Why", "The sky", "Numbers: 1"],
        [others[0], p, *others[1:4]],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [again] = smol4.generate("My favourite colour is", p, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    different = [
        smol4.generate("My favourite colour is", SamplingParams(max_tokens=6, temperature=1.0, seed=s), use_tqdm=False)[
            0
        ]
        for s in range(4)
    ]
    assert len({tuple(d.outputs[0].token_ids) for d in different}) > 1


def test_request_metrics_are_in_order(smol4):
    """vLLM's RequestOutput.metrics: arrival, first step, first generated token, end (no first token without one)."""
    started = time.time()
    long, short, prefill = smol4.generate(
        ["Hello there", "Why", "The sky"],
        [SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=1),
         SamplingParams(max_tokens=0, prompt_logprobs=1)],
        use_tqdm=False,
    )  # fmt: skip
    for out, n in ((long, 8), (short, 1)):
        m = out.metrics
        assert started <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.finished_time <= time.time()
        assert m.num_generated_tokens == n
    assert long.metrics.finished_time > long.metrics.first_token_time  # (seven more steps)
    assert prefill.metrics.first_token_time is None and prefill.metrics.finished_time >= prefill.metrics.arrival_time


def test_stops_logprobs_and_hidden_states(smol):
    [greedy] = smol.generate("1, 2, 3, 4,", SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    text = greedy.outputs[0].text
    stop = text.strip().split(",")[1].strip() if "," in text else text[2:4]
    [stopped] = smol.generate("1, 2, 3, 4,", SamplingParams(max_tokens=10, temperature=0, stop=[stop]), use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop" and stop not in stopped.outputs[0].text
    assert text.startswith(stopped.outputs[0].text)
    first_token = greedy.outputs[0].token_ids[1]
    [by_id] = smol.generate(
        "1, 2, 3, 4,", SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first_token]), use_tqdm=False
    )
    assert by_id.outputs[0].token_ids == greedy.outputs[0].token_ids[:2]
    assert by_id.outputs[0].finish_reason == "stop"
    p = SamplingParams(max_tokens=3, temperature=0, logprobs=4, return_hidden_states=True)
    [out] = smol.generate("The capital of France is", p, use_tqdm=False)
    assert len(out.outputs[0].logprobs) == 3
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 4 and all(v.logprob <= 0 for v in entry.values())
    [ref] = smol.trace([out.prompt_token_ids + out.outputs[0].token_ids[:-1]], "ln_final.hook_out")
    assert rel_err(out.hidden_states, ref["ln_final.hook_out"]) < 1e-5


def test_a_vllm_script_ports_unchanged(smol, hf_smol):
    """What vLLM scripts read and pass: TextPrompt / TokensPrompt dicts, `llm.get_tokenizer()`,
    `out.finished` and `completion.cumulative_logprob` (each an AttributeError or a refused prompt before)."""
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    ids = smol.tokenizer(PROMPTS[0])["input_ids"]
    plain = smol.generate([PROMPTS[0], ids], params, use_tqdm=False)
    dicts = smol.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert [o.prompt for o in dicts] == [PROMPTS[0], None] and dicts[0].finished
    assert smol.get_tokenizer() is smol.tokenizer
    [one] = smol.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    completion = one.outputs[0]
    with torch.inference_mode():
        logp = hf_smol(torch.tensor([ids + completion.token_ids[:-1]])).logits[0, len(ids) - 1 :].log_softmax(-1)
    expected = logp.gather(-1, torch.tensor(completion.token_ids)[:, None]).sum().item()
    assert abs(completion.cumulative_logprob - expected) <= 1e-4 * abs(expected)
    [no_logprobs] = smol.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert no_logprobs.outputs[0].cumulative_logprob is None  # vLLM's, when logprobs were not asked for
    # every log-probability names its token as vLLM's Logprob.decoded_token does: the token decoded alone
    [named] = smol.generate(ids, SamplingParams(max_tokens=3, temperature=0, logprobs=3, prompt_logprobs=2), use_tqdm=False)
    entries = named.outputs[0].logprobs + named.prompt_logprobs[1:]
    assert len(entries) == 3 + len(ids) - 1 and all(len(e) >= 2 for e in entries)
    for e in entries:
        assert all(lp.decoded_token == smol.tokenizer.decode([t]) for t, lp in e.items())
    with pytest.raises(ValueError, match=r"prompts\[0\]: a prompt dict holds one of prompt, prompt_token_ids"):
        smol.generate([{"prompt": "hi", "mm_processor_kwargs": {}}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]\.multi_modal_data: vlens takes \{'image'"):  # (test_images.py)
        smol.generate([{"prompt": "hi", "multi_modal_data": {}}], params, use_tqdm=False)


def test_a_prompt_dicts_cache_salt_keeps_its_prefix_apart(smol4):
    """vLLM's TextPrompt / TokensPrompt cache_salt: a prompt's cached blocks serve only prompts with its salt; the
    tokens are the same either way."""
    prompt = "The history of the Roman Empire, told briefly: " * 8
    params = SamplingParams(max_tokens=3, temperature=0)
    smol4.reset_prefix_cache()
    runs = [smol4.generate(p, params, use_tqdm=False)[0]
            for p in ({"prompt": prompt, "cache_salt": "a"}, {"prompt": prompt, "cache_salt": "a"},
                      {"prompt": prompt, "cache_salt": "b"}, prompt)]  # fmt: skip
    assert [o.num_cached_tokens for o in runs][0] == 0 and runs[1].num_cached_tokens > 0
    assert runs[2].num_cached_tokens == runs[3].num_cached_tokens == 0
    assert len({tuple(o.outputs[0].token_ids) for o in runs}) == 1
    with pytest.raises(ValueError, match=r"^prompts\[0\]\.cache_salt: '' is not allowed; expected a non-empty"):
        smol4.generate([{"prompt": prompt, "cache_salt": ""}], params, use_tqdm=False)


def test_chat_uses_the_template(smol):
    messages = [{"role": "user", "content": "Say hi"}]
    [out] = smol.chat(messages, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    rendered = smol.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == smol.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    "make, field",
    [
        (
            lambda llm: llm.generate(
                "hi", SamplingParams(capture=Capture(hooks="blocks.99.hook_resid_post")), use_tqdm=False
            ),
            "blocks.99",
        ),
        (
            lambda llm: llm.generate(
                "hi", SamplingParams(max_tokens=2, capture=Capture(hooks="hook_embed", positions=[50])), use_tqdm=False
            ),
            "capture.positions",
        ),
        (lambda llm: llm.generate("", SamplingParams(), use_tqdm=False), "prompts[0]"),
        (lambda llm: llm.generate("word " * 9000, SamplingParams(), use_tqdm=False), "max_model_len"),
        (lambda llm: SamplingParams(max_tokens=-1), "max_tokens"),
        (lambda llm: SamplingParams(top_p=0.0), "top_p"),
        (lambda llm: SamplingParams(top_p=1.5), "top_p"),
        (lambda llm: Capture(positions="middle"), "capture.positions"),
        (lambda llm: Capture(dtype="int8"), "capture.dtype"),
        (lambda llm: Capture(dtype=torch.int32), "capture.dtype"),  # (a torch dtype was taken as it came)
        (lambda llm: Capture(dtype=torch.float64), "capture.dtype"),
        (lambda llm: Capture(exclude_token_ids="1"), "capture.exclude_token_ids"),  # (failed when bound)
        (lambda llm: Capture(exclude_token_ids=[-1]), "capture.exclude_token_ids"),
        (lambda llm: Capture(exclude_token_ids=7), "capture.exclude_token_ids"),
        (lambda llm: llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False), "sampling_params"),
    ],
)
def test_bad_input_is_a_clear_error(smol, make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        make(smol)
    assert not smol.engine.has_work()  # nothing half-started


def test_exclude_token_ids_takes_numpy_and_torch_ids():
    for ids in ([np.int64(2)], torch.tensor([2, 3]), {2}):
        assert Capture(exclude_token_ids=ids).exclude_token_ids == frozenset(int(i) for i in ids)


def test_an_interrupted_generate_leaves_nothing_behind(smol, monkeypatch):
    """Ctrl-C during generate() left its requests in the engine, and the next call failed with a KeyError on
    their ids when they ended there."""
    params = SamplingParams(max_tokens=4, temperature=0)
    [expected] = smol.generate("Hello", params, use_tqdm=False)
    step, calls = smol.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(smol.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        smol.generate(["Once upon a time", "The sky is"], params, use_tqdm=False)
    assert not smol.engine.has_work()
    [again] = smol.generate("Hello", params, use_tqdm=False)
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids


def test_capture_disabled_fails_before_running(smol4_path):
    llm = LLM(model=str(smol4_path), dtype="float32", device="cpu", enable_capture=False, kv_cache_memory=64 << 20)
    p = SamplingParams(max_tokens=2, capture=Capture(hooks="blocks.0.hook_resid_post"))
    with pytest.raises(ValueError, match="enable_capture=True"):
        llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=2), p], use_tqdm=False)
    assert not llm.engine.has_work()
    [out] = llm.generate("fine", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_text_options_without_a_tokenizer_are_refused_up_front(tmp_path):
    """A checkpoint without tokenizer files takes token ids; streaming and stop strings, which read text,
    are refused when the request is added (they used to fail inside a step), and the engine runs on."""
    from family_parity import COMMON, build
    from transformers import LlamaConfig

    from vlens.engine.llm_engine import NewRequest

    llm = LLM(model=build(LlamaConfig(**COMMON), tmp_path, "llama"), dtype="float32", device="cpu")
    greedy = SamplingParams(max_tokens=3, temperature=0)
    for request, field in ((NewRequest([5, 6], greedy, stream=True), "stream"),
                           (NewRequest([5, 6], SamplingParams(stop="x")), "stop")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{field}: .*no tokenizer files"):
            llm.engine.add_requests([NewRequest([7], greedy), request])
        assert not llm.engine.has_work()  # nothing half-started, the valid request neither
    [out] = llm.generate([[5, 6]], greedy, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
