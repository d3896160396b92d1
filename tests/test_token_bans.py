"""vLLM's sampling options that ban tokens — `allowed_token_ids`, `bad_words`, `min_tokens` — and
`include_stop_str_in_output` and `skip_special_tokens`: the bans against a written-out reference over the same
logits (other rows untouched), greedy tokens against HF's generate with its own processors for the same bans
(prefix_allowed_tokens_fn, bad_words_ids, min_new_tokens), every request in a mixed batch as it is alone, stop
strings held back until min_tokens and kept where asked, special tokens' text where asked, streamed pieces that add
up (the bad values refused by name are tests/test_sampling_options.py's). On SmolLM2 cut to four layers
(conftest.smol4): what they check holds for any model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from family_parity import COMMON, build
from transformers import LlamaConfig

from vlens import LLM, SamplingParams
from vlens.capture.bind import RequestTaps
from vlens.engine.detokenizer import Detokenizer
from vlens.engine.penalties import spell_bad_words
from vlens.engine.sampler import SamplingBatch, sample
from vlens.engine.sequence import Sequence

CPU = torch.device("cpu")
PROMPT = "My favourite colour is blue, and my favourite food is"


def ON_HOST(name: str, values: torch.Tensor) -> torch.Tensor:  # noqa: N802 - the runner's buffers, on the CPU
    return values


def _seq(params: SamplingParams, generated: list[int], bad_words: list[list[int]] = (), stops=frozenset({0, 1})):
    seq = Sequence("0", [2, 3], params, seed=0, stop_ids=frozenset(stops), taps=RequestTaps())
    seq.token_ids += generated
    seq.bad_words_ids = list(bad_words)
    return seq


def test_bans_equal_the_reference_and_leave_other_rows_alone():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g) * 4
    never = float("-inf")
    words = [[12], [20, 21], [30, 31, 32]]
    cases = [  # (sequence, the tokens it may sample; None: all but those banned, then its logits' bias)
        (_seq(SamplingParams(temperature=0), [5, 6]), None, set()),  # untouched
        (_seq(SamplingParams(temperature=0, allowed_token_ids=[3, 9, 27], logit_bias={9: 2.0, 4: 50}), [5]),
         {3, 9, 27}, set()),
        (_seq(SamplingParams(temperature=0, min_tokens=3), [7, 8]), None, {0, 1}),  # two of three: stops banned
        (_seq(SamplingParams(temperature=0, min_tokens=2, presence_penalty=1.0), [7, 8]), None, set()),  # reached
        (_seq(SamplingParams(temperature=0.5, seed=3, bad_words=["x"]), [9, 30, 31], words), None, {12, 32}),
        (_seq(SamplingParams(temperature=0, bad_words=["x"], min_tokens=9), [20], words, stops={5}), None,
         {12, 21, 5}),
    ]  # fmt: skip
    batch = SamplingBatch.of([seq for seq, _, _ in cases], ON_HOST, CPU)
    adjusted = batch.adjust.apply(logits)
    assert torch.equal(adjusted[0], logits[0])
    for i, (seq, allowed, banned) in enumerate(cases):
        want = logits[i].clone()
        if allowed is not None:
            want[[t for t in range(40) if t not in allowed]] = never
        want[sorted(banned)] = never
        for token, bias in seq.params.logit_bias.items():
            want[token] += bias
        want[[7, 8]] -= seq.params.presence_penalty
        assert torch.equal(adjusted[i], want), i
    assert sample(logits, batch)[:4].tolist() == adjusted[:4].argmax(-1).tolist()
    assert sample(logits, batch)[1].item() in {3, 9, 27}
    assert SamplingBatch.of([cases[0][0], _seq(SamplingParams(min_tokens=2), [7, 8])], ON_HOST, CPU).adjust is None
    assert _seq(SamplingParams(min_tokens=5), [], stops=()).adjusts_logits is False  # (no stop to ban)


def test_bad_words_are_spelt_at_the_start_and_after_a_space(smol4):
    tok = smol4.tokenizer
    spelt = spell_bad_words(["pizza", " Paris France"], tok)
    assert [tok.encode(w, add_special_tokens=False) for w in ("pizza", " pizza")] == spelt[:2]
    assert tok.encode("Paris France", add_special_tokens=False) in spelt and len(spelt) == 4
    assert {tok.decode(ids).strip() for ids in spelt} == {"pizza", "Paris France"}


@pytest.fixture(scope="module")
def hf_smol4(smol4_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol4_path, dtype=torch.float32).eval()


def _hf_greedy(hf, tok, prompt: str, max_tokens: int, **processors) -> list[int]:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **processors)
    return out[0, ids.shape[1] :].tolist()


def test_greedy_tokens_equal_hf_with_the_same_bans_in_one_batch(smol4, hf_smol4):
    tok = smol4.tokenizer
    n = 12
    plain = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    [base] = smol4.generate(PROMPT, plain, use_tqdm=False)
    first, second = base.outputs[0].token_ids[:2]
    words = [tok.decode([first]).strip(), tok.decode(base.outputs[0].token_ids[3:5]).strip()]
    allowed = sorted(set(tok.encode(" and the of a pizza", add_special_tokens=False)))
    requests = [  # (params, HF's processors for the same bans)
        (plain, {}),
        (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, bad_words=words),
         {"bad_words_ids": spell_bad_words(words, tok)}),
        (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, allowed_token_ids=allowed),
         {"prefix_allowed_tokens_fn": lambda batch, ids: allowed}),
        (SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[second], min_tokens=6),  # ended by it at 6
         {"eos_token_id": second, "min_new_tokens": 6}),
    ]  # fmt: skip
    together = smol4.generate([PROMPT] * len(requests), [p for p, _ in requests], use_tqdm=False)
    for (params, processors), out in zip(requests, together, strict=True):
        tokens = out.outputs[0].token_ids
        want = _hf_greedy(hf_smol4, tok, PROMPT, n, **processors)
        assert tokens == want[: len(tokens)] and (len(tokens) == n or tokens[-1] == second), (params, tokens, want)
        assert tokens == smol4.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids  # alone
    banned, only, late = (out.outputs[0].token_ids for out in together[1:])
    assert banned != base.outputs[0].token_ids and first not in banned
    assert set(only) <= set(allowed)
    assert late.index(second) >= 6 and second not in late[:6]


def test_min_tokens_holds_back_stop_strings_and_include_keeps_them(smol4):
    """vLLM's rules: no stop string ends the text before min_tokens tokens; after them one is looked for in the text
    that ends past them; include_stop_str_in_output keeps the stop string, or the stop token's text."""
    tok = smol4.tokenizer
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    [base] = smol4.generate(PROMPT, plain, use_tqdm=False)
    tokens, text = base.outputs[0].token_ids, base.outputs[0].text
    stop = text.strip()[0]  # the first character: it ends the text at once without min_tokens

    def run(**options):
        return smol4.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop,
                                                     **options), use_tqdm=False)[0].outputs[0]  # fmt: skip

    def text_of(k: int) -> str:
        return tok.decode(tokens[:k], skip_special_tokens=True)

    cut = run()
    assert cut.text == text[: text.index(stop)] and cut.stop_reason == stop
    kept = run(include_stop_str_in_output=True)
    assert kept.text == text[: text.index(stop) + 1] and kept.token_ids == cut.token_ids
    late = run(min_tokens=4)
    after = text.find(stop, len(text_of(4)))  # (one character: no overlap with the text of the first 4 tokens)
    assert late.text == (text[:after] if after >= 0 else text) and len(late.token_ids) > 4
    token = tokens[2]
    for strings in (None, ["never in it"]):  # (decoded at the end; or token by token, for the stop strings)
        by_token = smol4.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[token],
                                                         stop=strings, include_stop_str_in_output=True),
                                  use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert by_token.text == text_of(3) and by_token.stop_reason == token
    assert smol4.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[token]),
                          use_tqdm=False)[0].outputs[0].text == text_of(2)  # fmt: skip
    special = tok.convert_tokens_to_ids("<|im_start|>")  # (skip_special_tokens: the text of special tokens)
    for skip, text in (True, ""), (False, "<|im_start|><|im_start|>"):
        for strings in (None, ["never in it"]):
            params = SamplingParams(max_tokens=2, allowed_token_ids=[special], skip_special_tokens=skip, stop=strings)
            assert smol4.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text == text


@pytest.mark.parametrize("min_tokens, keep", [(0, False), (0, True), (3, False), (3, True), (7, True)])
def test_streamed_pieces_add_up_to_vllms_text(smol4, min_tokens, keep):
    tok = smol4.tokenizer
    tokens = tok.encode(" pizza, pasta and ice cream. I like pasta, pizza, and cake.", add_special_tokens=False)
    stops = [", and", "pasta", "a"]

    def vllms() -> tuple[str, str]:
        """vLLM's detokenizer, token by token: from the token after min_tokens, each stop string is looked for where
        it ends in the text that token added."""
        for k in range(min_tokens + 1, len(tokens) + 1):
            before, now = tok.decode(tokens[: k - 1]), tok.decode(tokens[:k])
            hits = [(at, s) for s in stops if (at := now.find(s, max(0, len(before) - len(s) + 1))) >= 0]
            if hits:
                at, stop = min(hits)
                return stop, now[: at + (len(stop) if keep else 0)]
        raise AssertionError("no stop")

    streamed = Detokenizer(tok, tok.encode(PROMPT), SamplingParams(stop=stops, min_tokens=min_tokens,
                                                                   include_stop_str_in_output=keep))  # fmt: skip
    pieces, stop = [], None
    for token in tokens:
        stop = streamed.add(token)
        pieces.append(streamed.release(final=stop is not None))
        if stop is not None:
            break
    assert (stop, "".join(pieces)) == vllms() and streamed.text == "".join(pieces)
    assert len(streamed.text) > len(tok.decode(tokens[:min_tokens])) - len(stop)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"allowed_token_ids": [5, 49152]}, r"^allowed_token_ids: token ids \[49152\]"),
        # (a stop token is banned until min_tokens: a ban outside the logits failed the step, and so its batch)
        ({"stop_token_ids": [2, 50000], "min_tokens": 3}, r"^stop_token_ids: token ids \[50000\]"),
        ({"stop_token_ids": [-1]}, r"^stop_token_ids: \[-1\] is not allowed; expected a list of token ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_fail_before_running(smol4, fields, message):
    with pytest.raises(ValueError, match=message):
        smol4.generate(["fine", "not"], [SamplingParams(), SamplingParams(**fields)], use_tqdm=False)
    assert not smol4.engine.has_work()


def test_texts_spelt_outside_the_logits_fail_before_running(smol_path, tmp_path):
    """A model of 300 logits under SmolLM2's tokenizer of 49,152: a prompt, or a bad word, it spells with a token
    past them (an IndexError in the step, and so for its whole batch, before)."""
    path = build(LlamaConfig(**COMMON), tmp_path, "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_path / name, Path(path) / name)
    llm = LLM(model=path, dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    [ok] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, bad_words=["e"]), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 4 and not {85, 297} & set(ok.outputs[0].token_ids)  # ("e", " e")
    spelt = r"^bad_words: token ids \[38066, 4979\] \(as the tokenizer spells \['fine'\]\) outside the vocabulary"
    with pytest.raises(ValueError, match=spelt):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(), SamplingParams(bad_words=["fine"])], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: token ids \[38066\] \(the tokenizer's, for this text\)"):
        llm.generate([[5, 6], "fine"], use_tqdm=False)
    assert not llm.engine.has_work()
