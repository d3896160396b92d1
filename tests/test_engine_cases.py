"""Engine cases found in review, each on a tiny random Llama: a request batched, chunked, preempted or
served after others must end exactly as it does alone on a plain engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from transformers import LlamaConfig

from vlens import LLM, Capture, Patch, Positions, SamplingParams, Steer
from vlens.engine.llm_engine import NewRequest

D = COMMON["hidden_size"]
TINY = {"dtype": "float32", "device": "cpu", "block_size": 4, "kv_cache_memory": 1 << 20}


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return build(LlamaConfig(**COMMON, num_key_value_heads=2), tmp_path_factory.mktemp("cases"), "llama")


@pytest.fixture(scope="module")
def alone(path) -> LLM:
    return LLM(model=path, enable_prefix_caching=False, async_scheduling=False, **TINY)


@pytest.mark.parametrize("positions", ["prompt", "generated"])
def test_a_steer_by_prompt_length_takes_no_kv_from_a_prompt_of_another_length(path, alone, positions):
    """Steering "prompt" / "generated" rows changes different rows for prompts of different lengths: a request
    whose prompt is an earlier one's prompt and output must not get that one's KV from the prefix cache."""
    steer = [Steer("blocks.0.hook_resid_post", torch.randn(D, generator=torch.Generator().manual_seed(0)), scale=4.0,
                   positions=positions)]  # fmt: skip
    llm = LLM(model=path, **TINY)
    prompt = list(range(10, 18))
    first = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, interventions=steer),
                         use_tqdm=False)[0]  # fmt: skip
    longer = prompt + first.outputs[0].token_ids
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, interventions=steer,
                            capture=Capture("blocks.2.hook_resid_post", positions="last"))  # fmt: skip
    got = llm.generate([longer], params, use_tqdm=False)[0]
    want = alone.generate([longer], params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    hook = "blocks.2.hook_resid_post"
    assert rel_err(got.activations[hook], want.activations[hook]) < 1e-5


def test_an_open_slice_reads_as_a_slice_in_errors(alone):
    """slice(1, None) printed as "1" (the look of position 1) in the error that refuses its values."""
    values = torch.zeros(3, D)
    params = SamplingParams(
        max_tokens=2, interventions=[Patch("blocks.0.hook_resid_post", values, positions=slice(1, None))]
    )
    with pytest.raises(ValueError, match=r"one row per position of 1:$"):
        alone.generate([list(range(10, 18))], params, use_tqdm=False)
    assert [str(Positions.parse(s)) for s in (slice(1, None), slice(None, 5), slice(None), slice(1, None, 2))] == [
        "1:",
        ":5",
        ":",
        "1::2",
    ]


@pytest.fixture(scope="module")
def worded(tmp_path_factory, smol_path) -> LLM:
    """The tiny Llama with SmolLM2's tokenizer, whose first 300 ids hold UTF-8's bytes (142 "Ã" = 0xC3, which
    begins "é"; 119 "©" = 0xA9, which ends it) and 253 " a"."""
    path = build(LlamaConfig(**COMMON, num_key_value_heads=2), tmp_path_factory.mktemp("worded"), "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_path / name, Path(path) / name)
    return LLM(model=path, **TINY)


@pytest.mark.parametrize(
    "prompt, forced, stop, text",
    [
        ([81, 82, 253], 142, [], "\ufffd"),  # it ends inside a character: U+FFFD, as tokenizer.decode gives it
        ([81, 82, 253], 253, [253], ""),  # a stop token: its text is left out
        ([81, 82, 142], 119, [], ""),  # it ends a character its prompt began: read after the prompt, no text
    ],
)
def test_a_request_has_the_same_text_streamed_or_not(worded, prompt, forced, stop, text):
    """A streamed request's text came from the incremental detokenizer, another's from decoding its tokens
    alone: the first left out a character still partial at the end, the second kept a stop token's text and
    read the first token without the prompt before it."""
    params = SamplingParams(max_tokens=1, temperature=0, logit_bias={forced: 100}, stop_token_ids=stop)
    whole = worded.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    engine, pieces, out = worded.engine, [], None
    engine.add_requests([NewRequest(prompt, params, stream=True)])
    while engine.has_work():
        for delta in engine.step():
            pieces.append(delta.text)
            out = delta.output or out
    assert whole.token_ids == out.outputs[0].token_ids == [forced]
    assert whole.text == out.outputs[0].text == "".join(pieces) == text
