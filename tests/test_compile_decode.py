"""compile_decode: on the CPU, decode steps run a forward compiled by inductor for their shape and taps
(C++ code generated and built here, once for the whole test). Tokens equal the eager engine's, captured rows
and a steered request's rows within 1e-5 (float32), with the C paged kernel inside the compiled graph."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from test_parity_gemma4 import CONFIGS as GEMMA4_CONFIGS
from transformers import LlamaConfig

from vlens import LLM, Capture, SamplingParams, Steer

D = COMMON["hidden_size"]


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    common = dict(max_tokens=10, temperature=0, ignore_eos=True)
    params = [
        SamplingParams(**common, capture=Capture(["blocks.1.hook_resid_post", "blocks.0.attn.hook_z"], positions="generated")),
        SamplingParams(**common, interventions=[Steer("blocks.0.hook_resid_post", torch.randn(D, generator=g), scale=4.0)],
                       capture=Capture(["blocks.2.hook_resid_post"], positions="generated")),  # fmt: skip
    ]
    return [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (6, 9)], params


FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    # a family whose forward calls super() (a closure cell in the code each compiled forward copies), keys shared
    # between layers and per-layer inputs left in the forward's context
    "gemma4": GEMMA4_CONFIGS["gemma4_per_layer_shared_kv"],
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_decode_steps_equal_the_eager_engine(tmp_path, family):
    path = build(FAMILIES[family](), tmp_path, family)
    prompts, params = _requests()
    eager = LLM(model=path, dtype="float32", device="cpu", block_size=4, enforce_eager=True)
    compiled = LLM(model=path, dtype="float32", device="cpu", block_size=4, compile_decode=True)
    want = eager.generate(prompts, params, use_tqdm=False)
    for _ in range(2):  # the second run reuses the compiled forward
        got = compiled.generate(prompts, params, use_tqdm=False)
        for a, b in zip(want, got, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.activations.keys() == b.activations.keys()
            for name, rows in a.activations.items():
                assert rel_err(b.activations[name], rows) < 1e-5, name
    stats = compiled.stats()
    assert stats.compiled_steps == 2 * 9 and stats.decode_compiles == 1 and stats.decode_compile_seconds > 0
    assert stats.static_eager_steps == 0 and eager.stats().compiled_steps == 0


@pytest.mark.parametrize(
    "settings, field", [({"enforce_eager": True}, "compile_decode"), ({"tensor_parallel_size": 2}, "compile_decode")]
)
def test_compile_decode_refuses_what_it_cannot_do(settings, field):
    with pytest.raises(ValueError, match=field):
        LLM(model="unused", compile_decode=True, **settings)


def test_shapes_past_the_limit_run_eagerly(tmp_path, monkeypatch):
    """Compiled forwards are kept for at most MAX_GRAPHS shapes; a step of another shape runs the static path
    eagerly (counted), with the same tokens."""
    import vlens.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "MAX_GRAPHS", 0)
    path = build(LlamaConfig(**COMMON, num_key_value_heads=2), tmp_path, "llama")
    prompts, params = _requests()
    compiled = LLM(model=path, dtype="float32", device="cpu", block_size=4, compile_decode=True)
    eager = LLM(model=path, dtype="float32", device="cpu", block_size=4, enforce_eager=True)
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (compiled, eager))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = compiled.stats()
    assert stats.decode_compiles == 0 and stats.compiled_steps == 0 and stats.static_eager_steps == 9


def test_a_compile_that_fails_leaves_decode_eager(tmp_path, monkeypatch, caplog):
    """Inductor unable to build (no C++ compiler, say): the step that compiled reruns eagerly, later steps run
    eagerly, the tokens are the eager engine's, and the log says why."""
    import vlens.engine.model_runner as model_runner

    def broken(*args, **kwargs):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler here")

        return run

    monkeypatch.setattr(model_runner.torch, "compile", broken)
    path = build(LlamaConfig(**COMMON, num_key_value_heads=2), tmp_path, "llama")
    prompts, params = _requests()
    compiled = LLM(model=path, dtype="float32", device="cpu", block_size=4, compile_decode=True)
    eager = LLM(model=path, dtype="float32", device="cpu", block_size=4, enforce_eager=True)
    with caplog.at_level("WARNING", logger="vlens.engine"):
        got = compiled.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for name, rows in a.activations.items():
            assert rel_err(b.activations[name], rows) < 1e-5, name
    assert "no C++ compiler here" in caplog.text and not compiled.runner.compile_decode
    stats = compiled.stats()
    assert stats.compiled_steps == 0 and stats.static_eager_steps == 9
