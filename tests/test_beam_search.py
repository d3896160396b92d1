"""vLLM's LLM.beam_search: on SmolLM2 cut to four layers, the beams and their cumulative log-probabilities equal HF's
beam search (no EOS: every beam as long), two prompts at once as each alone; on a scripted model, a beam ending in
EOS is complete and ranked by vLLM's score (its EOS not counted in its length); bad parameters refused by name; the
server's use_beam_search (completions and chat) gives LLM.beam_search's beams."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from server_helpers import running_server
from transformers import AutoModelForCausalLM, GenerationConfig

from vlens import BeamSearchParams, Logprob
from vlens.beam_search import beam_search
from vlens.outputs import CompletionOutput, RequestOutput
from vlens.server.config import ServerConfig

PROMPTS = ["My favourite colour is blue, and my favourite food is", "The quick brown fox"]


def test_beams_equal_hf_beam_search(smol4, smol4_path):
    hf = AutoModelForCausalLM.from_pretrained(smol4_path, dtype=torch.float32).eval()
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    both = smol4.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, both, strict=True):
        ids = smol4.tokenizer(prompt, return_tensors="pt")["input_ids"]
        config = GenerationConfig(num_beams=3, num_return_sequences=3, max_new_tokens=5, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, length_penalty=1.0)  # fmt: skip
        with torch.inference_mode():
            hf_out = hf.generate(ids, generation_config=config, output_scores=True, return_dict_in_generate=True)
        n = ids.shape[1]
        assert [s.tokens for s in out.sequences] == hf_out.sequences.tolist()
        for beam, hf_score in zip(out.sequences, hf_out.sequences_scores.tolist(), strict=True):
            assert math.isclose(beam.cum_logprob / 5, hf_score, rel_tol=1e-4)  # (HF's: over the 5 new tokens)
            assert beam.finish_reason == "length" and len(beam.logprobs) == 5 and beam.tokens[:n] == ids[0].tolist()
        assert out.sequences[0].text == smol4.tokenizer.decode(out.sequences[0].tokens)
        assert [s.tokens for s in smol4.beam_search(prompt, params)[0].sequences] == [s.tokens for s in out.sequences]


def test_a_beam_ending_in_eos_is_complete_and_ranked_by_vllms_score():
    """A scripted model over tokens 0-3 (0 is EOS): from the prompt, 0 (EOS) at 0.5 and 1 at 0.3, then 2 at 0.9 after
    anything else. The EOS beam ends at once; the others go on. vLLM's score, cum_logprob / length ** lp (an EOS not
    counted in the length), ranks the finished beam below the longer one at lp 1 (log 0.5 / 2 = -0.35 against
    log 0.243 / 5 = -0.28) and above it at lp 0 (the sums: -0.69 against -1.41)."""
    probs = {(): {0: 0.5, 1: 0.3, 2: 0.1, 3: 0.1}}

    def generate(ids, step):
        outs = []
        for tokens in ids:
            table = probs.get(tuple(tokens[2:]), {2: 0.9, 3: 0.05, 1: 0.03, 0: 0.02})
            top = sorted(table.items(), key=lambda kv: -kv[1])[: step.logprobs]
            entry = {t: Logprob(math.log(p), r + 1) for r, (t, p) in enumerate(top)}
            outs.append(RequestOutput("0", None, tokens, [CompletionOutput(0, "", [top[0][0]], "length", [entry])]))
        return outs

    [out] = beam_search(generate, [[7, 8]], BeamSearchParams(beam_width=2, max_tokens=3), frozenset({0}), None)
    finished = [s for s in out.sequences if s.finish_reason == "stop"]
    assert [s.tokens for s in finished] == [[7, 8, 0]] and math.isclose(finished[0].cum_logprob, math.log(0.5))
    assert [s.tokens for s in out.sequences] == [[7, 8, 1, 2, 2], [7, 8, 0]]
    assert [s.finish_reason for s in out.sequences] == ["length", "stop"]
    [long] = beam_search(generate, [[7, 8]], BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=0.0),
                         frozenset({0}), None)  # fmt: skip
    assert long.sequences[0].tokens == [7, 8, 0]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"beam_width": 0, "max_tokens": 4}, "beam_width"), ({"beam_width": 2, "max_tokens": True}, "max_tokens"),
     ({"beam_width": 2, "max_tokens": 4, "length_penalty": "1"}, "length_penalty")],
)  # fmt: skip
def test_bad_parameters(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        BeamSearchParams(**kwargs)


def test_the_servers_use_beam_search(smol4):
    """vLLM's use_beam_search, n the width: completions' choices are each prompt's beams in order, chat's the
    conversation's; what beam search leaves out (streams, logprobs) is refused by name."""
    tok = smol4.tokenizer
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    want = smol4.beam_search(PROMPTS, params)
    chat = [{"role": "user", "content": "Name a colour."}]
    chat_ids = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]  # fmt: skip
    [chat_want] = smol4.beam_search([chat_ids], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))

    def texts(out, prompt_ids: list[int]) -> list[str]:
        return [tok.decode(s.tokens[len(prompt_ids):]) for s in out.sequences]

    with running_server(smol4, ServerConfig()) as url:
        body = {"prompt": PROMPTS, "use_beam_search": True, "n": 3, "max_tokens": 5, "ignore_eos": True}
        out = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        beams = [text for prompt, found in zip(PROMPTS, want) for text in texts(found, tok(prompt)["input_ids"])]
        assert [c["text"] for c in out["choices"]] == beams
        assert [c["index"] for c in out["choices"]] == list(range(6)) and out["usage"]["completion_tokens"] == 30
        assert {c["finish_reason"] for c in out["choices"]} == {"length"}
        chat_body = {"messages": chat, "use_beam_search": True, "n": 2, "max_tokens": 4, "ignore_eos": True}
        out = httpx.post(url + "/v1/chat/completions", json=chat_body, timeout=120).json()
        assert [c["message"]["content"] for c in out["choices"]] == texts(chat_want, chat_ids)
        for field, value in (("stream", True), ("logprobs", 2)):
            refused = httpx.post(url + "/v1/completions", json=body | {field: value}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
