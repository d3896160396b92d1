"""The static decode step — what a CUDA graph captures and replays on a GPU — run eagerly on the CPU against
the ordinary step: decode batches padded to a power-of-two bucket (padding rows on the scratch block),
block tables padded to a page bucket, taps armed at power-of-two sizes, vlens.attention.decode's kernel.
Greedy tokens must be equal and every captured row and steered output within 1e-5 (float32), with plain,
capturing (hooks, logits, attention pattern, SAE features), steered, ablated, per-head steered and
clamped requests in one batch, on a GQA Llama and on Gemma 2 (soft-capping, sliding windows) — with the
gathering kernel, with the C paged kernel the CPU runs by default, and with the Triton paged kernel that CUDA
runs (here under Triton's interpreter)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from replayed_graphs import replay_graphs
from transformers import Gemma2Config, LlamaConfig

from vlens import LLM, SAE, Ablate, Capture, Clamp, SamplingParams, Steer
from vlens.attention.decode import DecodeBackend, kernel_layer
from vlens.attention.metadata import LayerKind
from vlens.attention.paged_decode_cpu import paged_decode_cpu
from vlens.layers import fused
from vlens.layers.mlp import activation

D = COMMON["hidden_size"]
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "gemma2": lambda: Gemma2Config(
        **COMMON, num_key_value_heads=2, head_dim=24, sliding_window=7, query_pre_attn_scalar=20,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def llm(request, tmp_path_factory) -> LLM:
    path = build(FAMILIES[request.param](), tmp_path_factory.mktemp("static"), request.param)
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8)


@pytest.fixture(scope="module")
def paged_kernel():
    """vlens.attention.paged_decode's kernel as Triton's interpreter runs it on the CPU (conftest)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from vlens.attention.paged_decode import paged_decode

    return paged_decode


@pytest.fixture(params=["gather", "c", "triton"])
def kernel(request, llm):
    """The static step's attention kernel for one test: the portable gathering one, the C one, or the Triton one."""
    default = llm.runner.decode_backend
    if request.param == "gather":
        llm.runner.decode_backend = DecodeBackend()
    elif request.param == "c":
        llm.runner.decode_backend = DecodeBackend(paged_decode_cpu)
    else:
        llm.runner.decode_backend = DecodeBackend(request.getfixturevalue("paged_kernel"), programs=8)
    yield request.param
    llm.runner.decode_backend = default


def _requests(seed: int, head_dim: int) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    sae = SAE(
        W_enc=torch.randn(D, 32, generator=g), b_enc=torch.randn(32, generator=g), W_dec=torch.randn(32, D, generator=g),
        b_dec=torch.randn(D, generator=g), architecture="standard", hook="blocks.1.hook_resid_post",
    )  # fmt: skip
    tc = SAE(
        W_enc=torch.randn(D, 32, generator=g), b_enc=torch.randn(32, generator=g), W_dec=torch.randn(32, D, generator=g),
        b_dec=torch.randn(D, generator=g), architecture="standard", hook="blocks.0.ln2.hook_out",
        hook_out="blocks.0.hook_mlp_out", apply_b_dec_to_input=False,
    )  # fmt: skip
    common = dict(max_tokens=12, temperature=0, ignore_eos=True)
    params = [
        SamplingParams(**common),
        SamplingParams(**common, capture=Capture(["blocks.1.hook_resid_post", "blocks.0.attn.hook_z", "unembed.hook_out"],
                                                  positions="generated")),  # fmt: skip
        SamplingParams(**common, capture=Capture(["blocks.2.attn.hook_pattern"], positions="all")),
        SamplingParams(**common, interventions=[Steer("blocks.0.hook_resid_post", torch.randn(D, generator=g), scale=4.0)],
                       capture=Capture(["blocks.2.hook_resid_post"], positions="generated")),  # fmt: skip
        SamplingParams(**common, interventions=[Ablate("blocks.1.hook_attn_out", torch.randn(D, generator=g))],
                       capture=Capture(["blocks.1.hook_resid_mid"], positions="generated")),  # fmt: skip
        SamplingParams(**common, interventions=[Steer("blocks.1.attn.hook_z", torch.randn(head_dim, generator=g),
                                                      heads=[1], scale=8.0)]),  # fmt: skip
        SamplingParams(**common, interventions=[Clamp("blocks.1.hook_resid_post", sae, 3, 5.0)], capture=Capture(sae=sae, top_k=4)),
        SamplingParams(**common, interventions=[Clamp(tc.writes, tc, 2, 3.0)], capture=Capture(["blocks.1.hook_resid_pre"])),
    ]
    lengths = [5, 9, 3, 14, 7, 4, 11, 6]  # crosses block boundaries; one prompt shorter than a block
    return [(torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist(), p) for n, p in zip(lengths, params)]


def _run(llm: LLM, static: bool, seed: int, padded: bool = True):
    """Generate with or without the static path (padded to buckets, as for a graph, or not: the CPU's own)."""
    runner = llm.runner
    default = runner.static_decode, runner.pad_decode
    runner.static_decode, runner.pad_decode = static, padded
    try:
        requests = _requests(seed, llm.config.head_dim)
        return llm.generate([t for t, _ in requests], [p for _, p in requests], use_tqdm=False)
    finally:
        runner.static_decode, runner.pad_decode = default


def _values(out) -> dict[str, torch.Tensor]:
    values = {f"act:{k}": v for k, v in out.activations.items()}
    for name, (ids, acts) in out.sae_features.items():
        values[f"sae_ids:{name}"], values[f"sae:{name}"] = ids.float(), acts
    return values


# Each kernel in the modes it runs in: the C and gathering ones on the CPU's own path (unpadded) and padded (a
# compiled decode step's); the Triton one padded, as CUDA graphs run it (on CUDA it runs in nothing else).
MODES = [("gather", True), ("gather", False), ("c", True), ("c", False), ("triton", True)]


@pytest.mark.parametrize(("kernel", "padded"), MODES, indirect=["kernel"],
                         ids=[f"{k}-{'padded' if p else 'unpadded'}" for k, p in MODES])  # fmt: skip
def test_static_decode_equals_the_ordinary_step(llm, kernel, padded):
    before = llm.runner.graph_stats.static_eager_steps
    eager, static = _run(llm, False, 1), _run(llm, True, 1, padded)
    assert llm.runner.graph_stats.static_eager_steps - before >= 10  # the decode steps took the static path
    for a, b in zip(eager, static):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        va, vb = _values(a), _values(b)
        assert va.keys() == vb.keys()
        for name in va:
            assert va[name].shape == vb[name].shape, name
            assert rel_err(vb[name], va[name]) < 1e-5, name


@pytest.mark.parametrize("kernel", ["gather", "c"], indirect=True)
def test_static_decode_batches_other_sizes_and_preempts(llm, kernel):
    """Batches of every bucket up to max_num_seqs, sequences joining and finishing between steps. (Not the Triton
    kernel: the interpreter takes seconds a step; test_paged_kernel_matches_the_gathering_kernel checks its rows,
    test_static_decode_equals_the_ordinary_step its padded batches in the engine.)"""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, COMMON["vocab_size"], (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (11,), generator=g)]
    params = [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True) for m in torch.randint(1, 15, (11,), generator=g)]
    default = llm.runner.static_decode, llm.runner.pad_decode
    llm.runner.static_decode = llm.runner.pad_decode = True
    try:
        static = llm.generate(prompts, params, use_tqdm=False)
        llm.runner.static_decode = False
        eager = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.runner.static_decode, llm.runner.pad_decode = default
    assert [o.outputs[0].token_ids for o in static] == [o.outputs[0].token_ids for o in eager]


def test_repeated_decode_steps_equal_the_ordinary_step(llm):
    """Decode steps that repeat the step before plan, arm and gather nothing per request (vlens.capture.rows:
    DecodePages.repeat): with batched captures of several windows, a different Steer per request and an
    Ablate, requests ending at different steps (each end breaks a series of repeats, the next step starts
    one), tokens and rows equal the ordinary step's, and once the requests are done the engine keeps
    none of their rows."""
    g = torch.Generator().manual_seed(3)
    layer = "blocks.1.hook_resid_post"
    captures = [Capture([layer, "blocks.0.attn.hook_z"], positions="generated"), Capture(layer, positions="all"),
                Capture([layer, "unembed.hook_out"], positions=slice(2, 12)), None]  # fmt: skip
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, capture=captures[i % 4],
                       interventions=[Steer("blocks.0.hook_resid_post", torch.randn(D, generator=g), scale=4.0)]
                       if i % 3 else [Ablate("blocks.1.hook_attn_out", torch.randn(D, generator=g), positions="all")],
                       return_hidden_states=i in (1, 3))  # (a second stream of its own, in batches of its own)
        for i, m in enumerate([14, 9, 14, 11, 6, 14, 12, 3])
    ]  # fmt: skip
    prompts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (5, 9, 3, 8, 6, 4, 11, 7)]
    runner, before = llm.runner, llm.stats().repeated_steps
    static = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats().repeated_steps - before >= 4  # of 13: after an end or a closing window, a step plans anew
    assert not runner.pages._pages  # the requests' pages went with them
    default = runner.static_decode
    runner.static_decode = False  # every step planned stream by stream
    try:
        eager = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.static_decode = default
    for a, b in zip(eager, static):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.hidden_states is None) == (b.hidden_states is None)
        assert a.hidden_states is None or rel_err(b.hidden_states, a.hidden_states) < 1e-5
        assert a.activations.keys() == b.activations.keys()
        assert torch.equal(a.activation_positions, b.activation_positions) if a.activations else True
        for name in a.activations:
            assert a.activations[name].shape == b.activations[name].shape, name
            assert rel_err(b.activations[name], a.activations[name]) < 1e-5, name


@pytest.mark.parametrize("max_graphs", [64, 2])
def test_replayed_graphs_equal_the_ordinary_step(tmp_path, monkeypatch, max_graphs):
    """The static step with graphs, replays emulated on the CPU (tests/replayed_graphs.py), equals the ordinary step —
    also when a step's tap indices outgrow their buffer (an attention pattern's rows widen as its request
    generates), which moves every step buffer to a new block while that step is being planned, and when
    graphs are dropped and captured again (at most `max_graphs` kept)."""
    import vlens.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "MAX_GRAPHS", max_graphs)
    llm = LLM(model=build(FAMILIES["llama"](), tmp_path, "llama"), dtype="float32", device="cpu", block_size=4,
              max_num_seqs=8, max_num_batched_tokens=16)  # fmt: skip
    runner = llm.runner
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (5, 3, 7)]
    common = dict(max_tokens=40, temperature=0, ignore_eos=True)
    params = [
        SamplingParams(**common), SamplingParams(**common, capture=Capture(["blocks.2.attn.hook_pattern"], positions="generated")),
        SamplingParams(**common, interventions=[Steer("blocks.0.hook_resid_post", torch.randn(D, generator=g), scale=4.0)],
                       capture=Capture(["blocks.1.hook_resid_post"], positions="generated")),
    ]  # fmt: skip

    generation = runner.buffers.generation
    replay_graphs(runner)
    replayed = llm.generate(prompts, params, use_tqdm=False)  # first, while the buffers are small
    assert runner.graph_stats.graph_steps >= 30 and runner.buffers.generation > generation  # buffers grew
    assert len(runner._graphs) <= max_graphs < runner.graph_stats.graphs_captured or max_graphs == 64
    assert {key[2] for key in runner._graphs} == {runner.buffers.generation}  # none over moved buffers
    runner.graphs = runner.static_decode = runner.pad_decode = False
    for a, b in zip(llm.generate(prompts, params, use_tqdm=False), replayed, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.activations.keys() == b.activations.keys()
        for name, rows in a.activations.items():
            assert rel_err(b.activations[name], rows) < 1e-5, name


@pytest.mark.parametrize(
    "heads, kv_heads, dim, window, softcap, sinks, chunk",
    [(8, 2, 24, None, None, False, None), (4, 4, 64, 7, None, True, None), (9, 3, 64, None, 2.0, False, None),
     (8, 2, 32, 5, 3.0, True, None), (8, 2, 32, None, None, False, 24)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_kernel_matches_the_gathering_kernel(
    paged_kernel, heads, kv_heads, dim, window, softcap, sinks, chunk, dtype
):  # fmt: skip
    """Keys read through shuffled block tables, contexts from one key to the whole table, the splits of one
    row merged, a window or chunks: float32 within 1e-5 of the gathering kernel; float16 within its rounding.
    (bfloat16 takes float16's path; the interpreter's tl.dot misreads bfloat16, so a GPU checks it:
    DecodeBackend.for_device.)"""
    g = torch.Generator().manual_seed(heads * dim)
    bs, blocks, width, rows = 4, 64, 48, 5  # up to 192 keys: 3 key tiles of 64
    cache = torch.randn(2, blocks * bs, kv_heads, dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(rows)])
    context = torch.tensor([1, 2, 70, 130, width * bs])
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    kind = LayerKind(heads, kv_heads, dim, window, dim**-0.5, softcap, sinks, chunk=chunk)
    layer = kernel_layer(kind, cache[0], cache[1], 3 * torch.randn(heads, generator=g).to(dtype) if sinks else None)
    meta = SimpleNamespace(block_tables_device=tables, context_lens_device=context, block_size=bs)
    want = DecodeBackend().forward(q, None, None, layer, DecodeBackend().prepare(meta, {kind}, dtype))
    for programs in (1, 16, 400):  # one split per row, 2 or more, one per key tile (a windowed row's first
        # splits see no key, and the merge weighs them 0)
        paged = DecodeBackend(paged_kernel, programs)
        got = paged.forward(q, None, None, layer, paged.prepare(meta, {kind}, dtype))
        assert got.dtype == dtype and got.shape == want.shape
        assert rel_err(got.float(), want.float()) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_the_cpu_decodes_on_the_static_path_with_the_c_kernel(llm):
    """At float32 on the CPU, unless enforce_eager: the engine's decode steps read the paged cache in place."""
    assert llm.runner.decode_backend.paged is paged_decode_cpu and llm.runner.static_decode
    before = llm.runner.graph_stats.static_eager_steps
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.runner.graph_stats.static_eager_steps - before == 3
    eager = LLM(model=llm.model_path, dtype="float32", device="cpu", block_size=4, enforce_eager=True)
    assert eager.runner.decode_backend.paged is None and not eager.runner.static_decode
    bf16 = LLM(model=llm.model_path, dtype="bfloat16", device="cpu", block_size=4)
    assert bf16.runner.decode_backend.paged is None and not bf16.runner.static_decode  # (float32 only)


@pytest.mark.parametrize(
    "heads, kv_heads, dim, window, softcap, sinks, chunk",
    [(8, 2, 24, None, None, False, None), (4, 4, 64, 7, None, True, None), (9, 3, 64, None, 2.0, False, None),
     (8, 2, 32, 5, 3.0, True, None), (2, 1, 5, None, None, False, None), (6, 3, 44, None, None, False, None),
     (8, 2, 32, None, None, True, 48)],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_c_kernel_matches_the_gathering_kernel(heads, kv_heads, dim, window, softcap, sinks, chunk, threads):
    """Keys read through shuffled block tables, contexts from one key to the whole table, a batch of one whose
    keys split across threads (splits past its last key weighed 0), head sizes with and without a tail of
    fewer than 8 values (44: a run of 32 columns, one of 8, a tail of 4), a window or chunks (a row's keys from its
    chunk's first on): within 1e-5 of the gathering kernel."""
    g = torch.Generator().manual_seed(heads * dim)
    bs, blocks, width = 4, 300, 250
    cache = torch.randn(2, blocks * bs, kv_heads, dim, generator=g)
    kind = LayerKind(heads, kv_heads, dim, window, dim**-0.5, softcap, sinks, chunk=chunk)
    layer = kernel_layer(kind, cache[0], cache[1], 3 * torch.randn(heads, generator=g) if sinks else None)
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for context in ([1, 2, 70, 130, width * bs], [width * bs - 3]):
            rows = len(context)
            tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(rows)])
            q = torch.randn(rows, heads, dim, generator=g)
            meta = SimpleNamespace(block_tables_device=tables, context_lens_device=torch.tensor(context), block_size=bs)
            want = DecodeBackend().forward(q, None, None, layer, DecodeBackend().prepare(meta, {kind}, torch.float32))
            paged = DecodeBackend(paged_decode_cpu)
            got = paged.forward(q, None, None, layer, paged.prepare(meta, {kind}, torch.float32))
            assert got.shape == want.shape and rel_err(got, want) < 1e-5
    finally:
        torch.set_num_threads(default)


def test_fused_chains_run_only_in_forwards_that_ask(tmp_path):
    """vlens.layers.fused compiled (by inductor's CPU backend here; Triton on CUDA): a static decode whose
    forwards ask for the chains gives the plain ops' tokens and rows within 1e-5, and a runner that does not
    ask (enforce_eager, or no graphs) never calls the compiled code, though the process compiled it."""
    path = build(FAMILIES["llama"](), tmp_path, "llama")
    llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8)
    assert not llm.runner.fused
    assert fused.fuse(torch.device("cpu"), torch.float32, activation(llm.config.hidden_act))
    calls = {"n": 0}
    compiled = fused.rms_norm.compiled

    def counting(*args):
        calls["n"] += 1
        return compiled(*args)

    fused.rms_norm.compiled = counting
    try:
        plain = _run(llm, True, 3)
        assert calls["n"] == 0
        llm.runner.fused = True
        chained = _run(llm, True, 3)
        assert calls["n"] > 0
    finally:
        llm.runner.fused = False
        fused.rms_norm.compiled = compiled
    for a, b in zip(plain, chained):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        va, vb = _values(a), _values(b)
        for name in va:
            assert rel_err(vb[name], va[name]) < 1e-5, name


def test_without_a_compiler_decode_gathers_keys(monkeypatch, tmp_path, caplog):
    """No C compiler (or one that cannot build the kernel): the engine's decode attention gathers keys, and
    says why once; nothing fails."""
    from vlens.attention import paged_decode_cpu as module

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (no kernel built before)
    module._kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="vlens.engine"):
            backend = DecodeBackend.for_device(torch.device("cpu"), torch.float32)
    finally:
        module._kernel.cache_clear()
    assert backend.paged is None
    assert "decode attention gathers keys" in caplog.text and "no-such-cc" in caplog.text


def test_a_compiler_without_openmp_builds_the_kernel_single_threaded(monkeypatch, tmp_path):
    """A compiler that refuses -fopenmp (Apple's clang): the kernel is built without it, and agrees with the
    gathering kernel."""
    import shutil

    from vlens.attention import paged_decode_cpu as module

    fake = tmp_path / "cc"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {shutil.which("cc")} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    module._kernel.cache_clear()
    try:
        backend = DecodeBackend.for_device(torch.device("cpu"), torch.float32)
        assert backend.paged is paged_decode_cpu  # (it passed the trial against the gathering kernel)
        assert [p.name.startswith("paged_decode_cpu-") for p in (tmp_path / "vlens").iterdir()] == [True]
    finally:
        module._kernel.cache_clear()
