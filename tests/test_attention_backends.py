"""The attention-backend seam: FlexAttention over the paged cache gives SDPA's values on every family
(float32, within 1e-5), in a packed trace and through generation with prefill chunked small and decodes
in the same steps; backend choices that cannot run here are refused by name before the model loads.

FlexAttention runs uncompiled here (exact, slow on a CPU, with no compile to wait for); one test runs
it compiled, as `enforce_eager=False` does."""

from __future__ import annotations

import pytest
import torch
from family_parity import VOCAB, build
from hf_reference import same
from test_patterns import FAMILIES

from conftest import rel_err
from vlens import LLM, Capture, SamplingParams

HOOKS = ["hidden_states.*", "blocks.1.attn.hook_z", "unembed.hook_out"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    path = build(FAMILIES[request.param](), tmp_path_factory.mktemp("backends"), request.param)
    # A small cache (8 sequences of up to 64 tokens): FlexAttention's keys are every slot of it.
    common = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64)
    return (
        LLM(model=path, attention_backend="sdpa", **common),
        LLM(model=path, attention_backend="flex", enforce_eager=True, **common),
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 3, 9)]  # 19: chunked, past windows


def test_flex_trace_equals_sdpa(pair):
    sdpa, flex = pair
    for a, b in zip(sdpa.trace(_prompts(), HOOKS), flex.trace(_prompts(), HOOKS)):
        for name in a:
            assert same(b[name], a[name], 1e-5), name


def test_flex_generation_equals_sdpa(pair):
    sdpa, flex = pair
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=Capture(HOOKS[:2]))
    for a, b in zip(sdpa.generate(_prompts(), params, use_tqdm=False), flex.generate(_prompts(), params, use_tqdm=False)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for name in a.activations:
            assert rel_err(b.activations[name], a.activations[name]) <= 1e-5, name


def test_flex_reads_blocks_that_sequences_of_a_step_share(pair):
    """A block in several sequences' tables at once: a prefix borrowed within the step (prompts alike,
    with prompt log-probabilities), then the same prompts' full blocks from the prefix cache. FlexAttention
    once gave a shared slot to one sequence only."""
    sdpa, flex = pair
    head = _prompts()[0]
    prompts = [head + [5, 6], head, head[:10] + [7, 8, 9]]
    logprobs = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for params in (logprobs, plain):
        for a, b in zip(sdpa.generate(prompts, params, use_tqdm=False), flex.generate(prompts, params, use_tqdm=False)):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            if params is logprobs:
                got, expected = ([e[t].logprob for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
                                 for o in (b, a))  # fmt: skip
                assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_compiled_flex_equals_sdpa(tmp_path):
    path = build(FAMILIES["llama"](), tmp_path, "llama")
    common = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, max_model_len=64)
    sdpa = LLM(model=path, **common)
    flex = LLM(model=path, attention_backend="flex", **common)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=Capture("hidden_states.2"))
    [a], [b] = sdpa.generate(_prompts()[:1], params, use_tqdm=False), flex.generate(_prompts()[:1], params, use_tqdm=False)
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert rel_err(b.activations["hidden_states.2"], a.activations["hidden_states.2"]) <= 1e-5


@pytest.mark.parametrize(
    "backend, message",
    [("flashinfer", r"needs CUDA .* available on this cpu machine: auto, sdpa, flex"), ("triton", "attention_backend")],
)
def test_backends_that_cannot_run_here_are_refused_before_loading(backend, message, monkeypatch):
    import vlens.llm

    monkeypatch.setattr(vlens.llm, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=message):
        LLM(device="cpu", attention_backend=backend)
