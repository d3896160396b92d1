"""Compiled FlexAttention in two engines, one after the other in one process (a notebook's second cell):
each equals SDPA. The second engine's model differs (heads, sliding windows, soft-capping) and so does its
cache, which once made torch.compile recompile flex with dynamic sizes, and inductor's CPU flex template
then failed to build ("'cur_kvSplitSize1' was not declared in this scope"). Two compiles, ≈25 s each on a
2-core CPU."""

from __future__ import annotations

import torch
from conftest import rel_err
from family_parity import VOCAB, build
from test_patterns import FAMILIES

from vlens import LLM, Capture, SamplingParams


def test_compiled_flex_in_two_engines_equals_sdpa(tmp_path):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 3, 9)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=Capture("hidden_states.2"))
    for family, max_model_len in (("llama", 64), ("gemma2", 128)):  # different caches, as notebooks have
        path = build(FAMILIES[family](), tmp_path, family)
        common = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                      max_model_len=max_model_len)  # fmt: skip
        sdpa = LLM(model=path, attention_backend="sdpa", **common)
        flex = LLM(model=path, attention_backend="flex", **common)  # compiled: enforce_eager is off
        assert flex.stats().attention_backend == "flex" and flex.backend.compiled
        for a, b in zip(sdpa.generate(prompts, params, use_tqdm=False), flex.generate(prompts, params, use_tqdm=False)):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, family
            assert rel_err(b.activations["hidden_states.2"], a.activations["hidden_states.2"]) <= 1e-5, family
