"""vLLM's structured outputs on SmolLM2: a JSON schema, any JSON object, a regular expression, a choice, a grammar and
a structural tag, in one batch with a plain request, each with the greedy tokens of HF's generate under xgrammar's own
logits processor for the same compiled grammar; the texts held to their structures; a structured request's captured
and steered rows as any request's; seeded samples that keep to theirs, each the request alone with its seed; the
bitmask unpacked as xgrammar applies it; the server's response_format, structured_outputs and guided_* fields equal to
the offline requests; bad structures refused by name before any work."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
import xgrammar
from conftest import rel_err
from server_helpers import running_server

from vlens import Capture, SamplingParams, Steer, StructuredOutputsParams
from vlens.engine.structured import bitmask_rows, unpack
from vlens.server.config import ServerConfig
from vlens.server.protocol import CompletionRequest

MESSAGES = [{"role": "user", "content": "Describe a person named Ann, aged 31, as JSON with fields name and age."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
REGEX = r"[A-Z][a-z]+ is \d{1,3}"
STRUCTURES = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    "grammar": StructuredOutputsParams(grammar='root ::= ("Ann" | "Bob") " is " [0-9] [0-9]?'),
}


def _holds(kind: str, text: str) -> bool:
    if kind in ("json", "json_object"):
        value = json.loads(text)
        typed = kind == "json_object" or (type(value["name"]), type(value["age"])) == (str, int)
        return isinstance(value, dict) and typed
    if "structural_tag" in kind:
        return re.search(r'"age": 4\d,', text) is not None
    pattern = {"regex": REGEX, "choice": "yes|no|maybe", "grammar": r"(Ann|Bob) is [0-9]{1,2}"}[kind]
    return re.fullmatch(pattern, text) is not None


def _hf_greedy(hf, prompt_ids: list[int], compiled, max_tokens: int, eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                          logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)])  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_greedy_tokens_equal_hf_under_xgrammars_processor(smol, hf_smol):
    params = [SamplingParams(max_tokens=48, temperature=0, structured_outputs=s) for s in STRUCTURES.values()]
    outs = smol.chat([MESSAGES] * (len(params) + 1), params + [SamplingParams(max_tokens=8, temperature=0)],
                     use_tqdm=False)  # fmt: skip
    grammars, eos = smol.engine.grammars, sorted(smol.engine.eos_ids)
    for (kind, structure), out in zip(STRUCTURES.items(), outs, strict=False):
        c = out.outputs[0]
        want = _hf_greedy(hf_smol, out.prompt_token_ids, grammars.compile(structure), 48, eos)
        assert c.token_ids == want and c.finish_reason == "stop", (kind, c.text)
        assert _holds(kind, c.text), (kind, c.text)
    plain = smol.chat(MESSAGES, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    assert outs[-1].outputs[0].token_ids == plain.token_ids  # (the structures' masks stay in their rows)
    assert outs[2].outputs[0].text != plain.text


# A structural tag: the text is free until the model writes the trigger, then held to its tag's schema until the tag's
# end, then free again (Ann's age, 31, must come out in the forties here); xgrammar's form and vLLM's older one
AGE = {"type": "integer", "minimum": 40, "maximum": 49}
AGE_TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ['"age"'], "tags": [
    {"begin": '"age": ', "content": {"type": "json_schema", "json_schema": AGE}, "end": ","}]}}  # fmt: skip
OLDER_AGE_TAG = {"structures": [{"begin": '"age": ', "schema": AGE, "end": ","}], "triggers": ['"age"']}


def test_a_structural_tag_holds_only_the_tagged_text_as_hf_under_xgrammar(smol, hf_smol):
    forms = [AGE_TAG, json.dumps(AGE_TAG), OLDER_AGE_TAG]
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputsParams(structural_tag=t))
              for t in forms] + [SamplingParams(max_tokens=24, temperature=0)]  # fmt: skip
    *tagged, plain = [out.outputs[0] for out in smol.chat([MESSAGES] * 4, params, use_tqdm=False)]
    prompt = smol.chat(MESSAGES, params[-1], use_tqdm=False)[0].prompt_token_ids
    want = _hf_greedy(hf_smol, prompt, smol.engine.grammars.compile(params[0].structured_outputs), 24,
                      sorted(smol.engine.eos_ids))  # fmt: skip
    assert all(c.token_ids == want for c in tagged), [c.text for c in tagged]
    head, age = plain.text.split('"age": ')[0], re.search(r'"age": (\d+),', tagged[0].text)
    assert '"age": 31,' in plain.text and tagged[0].text.startswith(head + '"age": ') and 40 <= int(age[1]) <= 49
    assert tagged[0].text.count('"age') == 1 and len(tagged[0].text) > age.end() + 10  # (free again after the tag)


def test_seeded_samples_keep_to_the_structure_each_as_alone(smol):
    structure = STRUCTURES["grammar"]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3, structured_outputs=structure)
    [out] = smol.chat(MESSAGES, params, use_tqdm=False)
    assert all(_holds("grammar", c.text) for c in out.outputs), [c.text for c in out.outputs]
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(max_tokens=12, temperature=1.0, seed=3 + i, structured_outputs=structure)
        assert smol.chat(MESSAGES, alone, use_tqdm=False)[0].outputs[0].token_ids == c.token_ids
    ended = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, structured_outputs=STRUCTURES["choice"])
    c = smol.chat(MESSAGES, ended, use_tqdm=False)[0].outputs[0]  # (its EOS is not a stop: the structure ends it)
    assert (c.text, c.finish_reason) in {("yes", "stop"), ("no", "stop"), ("maybe", "stop")}


def test_a_structured_request_captures_and_steers_as_any_other(smol):
    """The structure only bans tokens: the rows a structured, steered request captures are the rows of its prompt and
    tokens run again with the same steer."""
    hook, vector = "blocks.10.hook_resid_post", torch.randn(576, generator=torch.Generator().manual_seed(0))
    steer = Steer("blocks.5.hook_resid_post", vector, scale=2.0)
    params = SamplingParams(max_tokens=24, temperature=0, structured_outputs=STRUCTURES["regex"], interventions=[steer],
                            capture=Capture(hook, positions="generated"))  # fmt: skip
    [out] = smol.chat(MESSAGES, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert _holds("regex", out.outputs[0].text)
    again = SamplingParams(max_tokens=0, interventions=[steer], capture=Capture(hook, positions="all"))
    [ref] = smol.generate([out.prompt_token_ids + tokens[:-1]], again, use_tqdm=False)
    rows = ref.activations[hook][len(out.prompt_token_ids) :]
    assert out.activations[hook].shape == rows.shape and rel_err(out.activations[hook], rows) < 1e-5


def test_the_bitmask_unpacks_as_xgrammar_applies_it():
    g = torch.Generator().manual_seed(0)
    vocab = 100
    bitmask = bitmask_rows(3, vocab)
    bitmask[1:] = torch.randint(-(2**31), 2**31 - 1, (2, bitmask.shape[1]), generator=g, dtype=torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    applied = logits.clone()
    xgrammar.apply_token_bitmask_inplace(applied, bitmask)
    assert torch.equal(unpack(bitmask, vocab), applied != float("-inf")) and bool(unpack(bitmask, vocab)[0].all())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "structured_outputs: set one of"),
        ({"regex": "a", "choice": ["a"]},
         "structured_outputs: set one of json, regex, choice, grammar, json_object, structural_tag; got regex, choice"),
        ({"choice": []}, "structured_outputs.choice: [] is not allowed; expected a list of non-empty strings"),
        ({"choice": ["a", ""]}, "structured_outputs.choice:"),
        ({"json": 3}, "structured_outputs.json:"),
        ({"json_object": "yes"}, "structured_outputs.json_object:"),
        ({"structural_tag": 3}, "structured_outputs.structural_tag: 3 is not allowed; expected a structural tag"),
    ],
)  # fmt: skip
def test_bad_structures(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "structure, field",
    [(StructuredOutputsParams(regex="(unclosed"), "regex"), (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
     (StructuredOutputsParams(json={"type": "no such type"}), "json"),
     (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "structural_tag"),
     (StructuredOutputsParams(structural_tag="{not json"), "structural_tag"),
     (StructuredOutputsParams(structural_tag={"structures": [{"begin": "<a>"}], "triggers": ["<a>"]}),
      "structural_tag")],
)  # fmt: skip
def test_a_structure_that_does_not_compile_fails_before_running(smol, structure, field):
    """xgrammar's own words, without its C++ log line's time, file and failed check."""
    with pytest.raises(ValueError, match=f"^structured_outputs.{field}: \\w") as refused:
        smol.generate(["fine", "not"], [SamplingParams(max_tokens=2), SamplingParams(structured_outputs=structure)],
                      use_tqdm=False)  # fmt: skip
    assert ".cc:" not in str(refused.value) and "Check failed" not in str(refused.value)
    assert not smol.engine.has_work()


@pytest.fixture(scope="module")
def server(served_smol):
    with running_server(served_smol, ServerConfig(served_model_name="smol")) as url:
        yield url


BODIES = {  # a body's fields -> the structure it asks for
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "person",
                                                                                                "schema": SCHEMA}}},
                                    "json"),
    "structured_outputs": ({"structured_outputs": {"regex": REGEX}}, "regex"),
    "guided_choice": ({"guided_choice": ["yes", "no", "maybe"]}, "choice"),
    "guided_grammar": ({"guided_grammar": STRUCTURES["grammar"].grammar}, "grammar"),
    "response_format structural_tag": ({"response_format": AGE_TAG}, "structural_tag"),
    "older response_format structural_tag": ({"response_format": {"type": "structural_tag", **OLDER_AGE_TAG}},
                                             "older_structural_tag"),
    "structured_outputs structural_tag": ({"structured_outputs": {"structural_tag": json.dumps(AGE_TAG)}},
                                          "structural_tag_text"),
}  # fmt: skip
SERVED = STRUCTURES | {  # (the server's structural tags, as the offline requests they are)
    "structural_tag": StructuredOutputsParams(structural_tag=AGE_TAG),
    "older_structural_tag": StructuredOutputsParams(structural_tag={"type": "structural_tag", **OLDER_AGE_TAG}),
    "structural_tag_text": StructuredOutputsParams(structural_tag=json.dumps(AGE_TAG)),
}


@pytest.mark.parametrize("fields, kind", BODIES.values(), ids=list(BODIES))
def test_the_servers_fields_equal_offline(server, smol, fields, kind):
    body = {"model": "smol", "messages": MESSAGES, "max_tokens": 48, "temperature": 0} | fields
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=SERVED[kind])
    [ref] = smol.chat(MESSAGES, params, use_tqdm=False)  # (not the served LLM: its engine is the server's)
    assert r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text and _holds(kind, ref.outputs[0].text)


def test_every_body_field_names_its_structure():
    """Each body field's structure, read without a run (json_object's reply here runs ~46 tokens: it is compared with
    HF's offline, not served)."""
    body = {"prompt": "Hi"}
    for fields, want in [({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
                         ({"response_format": {"type": "text"}}, None),
                         ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
                         ({"guided_regex": REGEX}, StructuredOutputsParams(regex=REGEX))] + [
                            (fields, SERVED[kind]) for fields, kind in BODIES.values()]:  # fmt: skip
        assert CompletionRequest(**body, **fields).structure() == want, fields


@pytest.mark.parametrize(
    "fields, param",
    [({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
     ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
     ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
     ({"guided_choice": []}, "guided_choice"),
     ({"guided_regex": "(unclosed"}, "guided_regex"),  # (one that does not compile: the field it came from)
     ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
      "response_format"),
     ({"response_format": {"type": "structural_tag"}}, "response_format.format"),
     ({"response_format": {"type": "structural_tag", "structures": OLDER_AGE_TAG["structures"]}},
      "response_format.triggers"),
     ({"response_format": AGE_TAG | {"triggers": ["<a>"]}}, "response_format.triggers"),
     ({"response_format": {"type": "json_object", "format": AGE_TAG["format"]}}, "response_format.format"),
     ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format"),
     ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag")],
)  # fmt: skip
def test_bad_structures_are_400s_naming_the_field(server, fields, param):
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 4} | fields
    r = httpx.post(server + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200
