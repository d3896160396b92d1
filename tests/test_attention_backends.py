"""The attention-backend seam: FlexAttention over the paged cache gives SDPA's values on every family
(float32, within 1e-5), in a packed trace and through generation with prefill chunked small and decodes
in the same steps; backend choices that cannot run here are refused by name before the model loads;
"auto" is SDPA on a CPU, logged and in stats(), and what it would pick on CUDA follows the model and dtype.

FlexAttention runs uncompiled here (exact, slow on a CPU, with no compile to wait for); test_flex_engines.py
runs it compiled, as `enforce_eager=False` does. The CUDA-only kernels (varlen, the memory-efficient SDPA
path) are tested here in the parts that run on a CPU: the arguments they are given and the head stacking;
their values on a GPU are benchmarks/gpu_suite.py's."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import rel_err
from family_parity import VOCAB, build
from hf_reference import same
from test_patterns import FAMILIES

import vlens.attention.varlen
from vlens import LLM, Capture, SamplingParams
from vlens.attention import LayerKind, choose, layout, make_backend
from vlens.attention.flex import FlexBackend, cuda_tiles
from vlens.attention.metadata import FULL_REACH
from vlens.attention.sdpa import _stacked, _stacked_mask
from vlens.attention.varlen import VarlenBackend, keywords, layer_arguments, takes_pages
from vlens.attention.varlen import problem as varlen_problem

HOOKS = ["hidden_states.*", "blocks.1.attn.hook_z", "unembed.hook_out"]


@pytest.fixture(scope="module", params=[name for name in FAMILIES if name != "bloom"])  # (flex refuses ALiBi:
def pair(request, tmp_path_factory):  # test_parity_bloom.py)
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


@pytest.mark.parametrize(
    "backend, message",
    [
        ("flashinfer", r"needs CUDA .* available on this cpu machine: auto, sdpa, flex$"),
        ("varlen", r"'varlen' needs CUDA and a torch with .*varlen_attn; available on this cpu machine: auto, sdpa, flex$"),  # noqa: E501
        ("triton", "attention_backend"),
    ],
)
def test_backends_that_cannot_run_here_are_refused_before_loading(backend, message, monkeypatch):
    import vlens.llm

    monkeypatch.setattr(vlens.llm, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=message):
        LLM(device="cpu", attention_backend=backend)


def test_auto_is_sdpa_on_a_cpu_logged_once_and_in_stats(pair, caplog):
    sdpa, flex = pair
    with caplog.at_level(logging.INFO, logger="vlens.engine"):
        auto = LLM(model=sdpa.model_path, dtype="float32", device="cpu", block_size=4, max_model_len=64)
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention backend:")]
    assert len(chosen) == 1 and chosen[0].startswith("attention backend: sdpa (auto on cpu")
    assert (auto.stats().attention_backend, sdpa.stats().attention_backend, flex.stats().attention_backend) == (
        "sdpa", "sdpa", "flex"
    )


KIND = LayerKind(num_heads=8, num_kv_heads=2, head_dim=64, window=None, scale=0.125, softcap=None)


def _varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None): ...


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)): ...


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None): ...


def _installed_varlen(monkeypatch, fn) -> None:
    """Make `fn` the varlen_attn this torch has, wherever vlens asks for it."""
    monkeypatch.setattr(vlens.attention, "varlen_function", lambda: fn)
    monkeypatch.setattr(vlens.attention.varlen, "varlen_function", lambda: fn)


def test_auto_on_cuda_follows_dtype_layers_and_paging(monkeypatch):
    """Decided without a GPU: FlashInfer is not installed here, and with a varlen_attn that takes block
    tables (torch 2.13's), varlen is chosen only where it reads the cache in place (blocks of a multiple of
    256)."""
    _installed_varlen(monkeypatch, _varlen_2_13)
    cuda = torch.device("cuda")
    assert choose(cuda, {KIND}, torch.bfloat16, 256)[0] == "varlen"
    assert choose(cuda, {KIND}, torch.bfloat16, 16) == (
        "sdpa", "varlen reads a paged cache in blocks of a multiple of 256 slots, not 16"
    )
    assert choose(cuda, {KIND}, torch.float32, 256)[0] == "sdpa"  # Flash Attention has no float32
    capped = KIND._replace(softcap=30.0)
    assert choose(cuda, {KIND, capped}, torch.bfloat16, 256) == (
        "sdpa", "varlen cannot soft-cap attention scores, which this model's layers do"
    )
    assert choose(torch.device("cpu"), {KIND}, torch.bfloat16, 256)[0] == "sdpa"


@pytest.mark.parametrize("fn", [_varlen_2_11, _varlen_2_10])
def test_auto_on_cuda_keeps_sdpa_where_varlen_cannot_page(monkeypatch, fn):
    """torch 2.11's varlen_attn (the GPU suite's) and 2.10's take no block tables: they would gather keys,
    as sdpa does, so auto stays with the reference kernel; varlen named still runs, over gathered keys."""
    _installed_varlen(monkeypatch, fn)
    cuda = torch.device("cuda")
    assert choose(cuda, {KIND}, torch.bfloat16, 256) == (
        "sdpa", "this torch's varlen_attn takes no block tables (it would gather keys, as sdpa does)"
    )
    backend = make_backend("varlen", cuda, False, {KIND}, torch.bfloat16, 256)
    assert not backend.pages and backend.prepare(_step(256), {KIND}, torch.bfloat16).key_slots is not None


@pytest.mark.parametrize(
    "kinds, dtype, message",
    [
        ({KIND}, torch.float32, "needs float16 or bfloat16 .*, not float32; use sdpa"),
        ({KIND._replace(softcap=50.0)}, torch.float16, "cannot soft-cap attention scores"),
        ({KIND._replace(head_dim=20)}, torch.bfloat16, r"needs head sizes that are multiples of 8 up to 256, not \[20\]"),  # noqa: E501
        ({KIND._replace(chunk=8192)}, torch.bfloat16, "has no chunked attention, which this model's layers have"),
    ],
)
def test_varlen_refuses_models_it_cannot_run(kinds, dtype, message):
    with pytest.raises(ValueError, match="attention_backend: 'varlen' " + message):
        make_backend("varlen", torch.device("cuda"), False, kinds, dtype, 16)


def test_varlen_arguments_follow_the_installed_signature():
    """Detected from the signature: paging, windows, scale and the grouped-query flag where it is taken,
    `is_causal` where it is not; what an older signature cannot say is refused by name."""
    assert takes_pages(_varlen_2_13) and not takes_pages(_varlen_2_11) and not takes_pages(_varlen_2_10)
    windowed = KIND._replace(window=6, scale=0.25)
    expected = {"window_size": (5, 0), "scale": 0.25, "enable_gqa": True}
    assert layer_arguments(windowed, keywords(_varlen_2_13)) == expected
    assert layer_arguments(KIND, keywords(_varlen_2_13))["window_size"] == (-1, 0)
    # 2.11: no grouped-query flag (Flash Attention takes fewer KV heads as they are); the tuple (-1, 0) is
    # what its varlen_attn compares with to run causally
    assert layer_arguments(windowed, keywords(_varlen_2_11)) == {"window_size": (5, 0), "scale": 0.25}
    assert layer_arguments(KIND, keywords(_varlen_2_11)) == {"window_size": (-1, 0), "scale": 0.125}
    assert varlen_problem({windowed}, torch.bfloat16, _varlen_2_11) is None
    assert layer_arguments(KIND, keywords(_varlen_2_10)) == {"is_causal": True}
    assert varlen_problem({KIND}, torch.bfloat16, _varlen_2_10) is None
    assert "takes window_size" in varlen_problem({KIND._replace(window=6)}, torch.bfloat16, _varlen_2_10)
    assert "takes scale" in varlen_problem({KIND._replace(scale=0.25)}, torch.bfloat16, _varlen_2_10)
    assert varlen_problem({windowed}, torch.bfloat16, _varlen_2_13) is None


def _step(block_size: int, num_slots: int = 4096):
    """Three sequences: a decode at position 9, a 5-token prefill chunk from 3, a whole 2-token prompt."""
    tables = [[7, 2, 5], [1, 4], [6]] if block_size == 4 else [[3], [1], [0]]
    return layout([9, 3, 0], [1, 5, 2], [10, 8, 2], tables, block_size, num_slots, lambda name, values: torch.as_tensor(values))


def test_a_paged_layout_lists_each_sequences_pages():
    """FlashInfer's paged layout (made when a backend asks): where each sequence's pages start, the pages,
    and the keys in each one's last page."""
    meta = _step(4)  # contexts of 10, 8 and 2 keys in blocks of 4: 3, 2 and 1 pages
    assert meta.page_indptr.tolist() == [0, 3, 5, 6] and meta.page_indptr.dtype == torch.int32
    assert meta.page_indices.tolist() == [7, 2, 5, 1, 4, 6] and meta.page_indices.dtype == torch.int32
    assert meta.last_page_lens.tolist() == [2, 4, 2] and meta.last_page_lens.dtype == torch.int32


def test_varlen_arguments_gather_keys_or_read_pages():
    backend = make_backend("varlen", torch.device("cuda"), False, {KIND}, torch.bfloat16, 4)  # builds no tensor on CUDA
    assert isinstance(backend, VarlenBackend)
    gathered = backend.prepare(_step(4), {KIND}, torch.bfloat16)  # blocks of 4 < 256: Flash Attention 2 cannot page
    assert (gathered.max_q, gathered.max_k, gathered.block_size, gathered.paging) == (5, 10, 0, {})
    assert gathered.cu_q.tolist() == [0, 1, 6, 8] and gathered.cu_k.tolist() == [0, 10, 18, 20]
    expected = [28, 29, 30, 31, 8, 9, 10, 11, 20, 21] + [4, 5, 6, 7, 16, 17, 18, 19] + [24, 25]
    assert gathered.key_slots.tolist() == expected
    backend.pages = True  # a torch whose varlen_attn takes block tables (the local one may not)
    paged = backend.prepare(_step(256), {KIND}, torch.bfloat16)
    assert paged.key_slots is None and paged.block_size == 256
    assert paged.paging["block_table"].dtype == torch.int32 and paged.paging["block_table"].tolist() == [[3], [1], [0]]
    assert paged.paging["seqused_k"].tolist() == [10, 8, 2] and paged.cu_k.tolist() == [0, 10, 18, 20]
    assert gathered.layers == paged.layers == {KIND: layer_arguments(KIND, backend.takes)}


def test_sdpa_reads_fresh_prompts_keys_where_they_are():
    """Prompts computed from their first token read their own rows under SDPA's causal mask (no gather, no
    mask); chunks after cached keys gather them, with a mask when several share a call and none (causal
    from the bottom right) for one alone, except for the layers whose window or soft cap needs it."""
    from vlens.attention.sdpa import SdpaBackend

    put = lambda name, values: torch.as_tensor(values)  # noqa: E731
    tables = [[3, 1, 5], [0, 2, 6]]
    fresh = layout([0, 0], [5, 4], [5, 4], tables, 4, 64, put)
    (group,) = SdpaBackend().prepare(fresh, {KIND}, torch.float32)
    assert group.key_slots is None and group.masks == {FULL_REACH: None}
    later = layout([4, 4], [5, 4], [9, 8], tables, 4, 64, put)
    (group,) = SdpaBackend().prepare(later, {KIND}, torch.float32)
    assert group.key_slots.tolist() == [[12, 13, 14, 15, 4, 5, 6, 7, 20], [0, 1, 2, 3, 8, 9, 10, 11, 0]]
    assert group.masks[FULL_REACH].shape == (2, 1, 5, 9) and not group.chunk_after_cache
    windowed = KIND._replace(window=3)
    alone, fresh_one = SdpaBackend().prepare(layout([4, 0], [5, 4], [9, 4], tables, 4, 64, put), {KIND, windowed}, torch.float32)
    # only the window's
    assert alone.chunk_after_cache and alone.key_slots is not None and set(alone.masks) == {(3, None)}
    assert fresh_one.key_slots is None


def test_flex_block_mask_covers_the_steps_keys_not_the_cache():
    """A cache of ten million slots: the mask and the gathered keys are sized by the step's 20 keys."""
    kinds = {KIND, KIND._replace(window=3)}
    state = FlexBackend(compiled=False).prepare(_step(4, num_slots=10_000_000), kinds, torch.float32)
    assert (state.rows, state.padded_rows, state.padded_keys, len(state.key_slots)) == (8, 128, 128, 128)
    for mask in state.masks.values():
        assert mask.kv_num_blocks.tolist() == [[[1]]] and mask.shape == (1, 1, 128, 128)
        dense = mask.to_dense()  # block level: the one query block reads the one key block
        assert dense.tolist() == [[[[1]]]]


def test_flex_tiles_fit_the_cards_shared_memory():
    """The estimate reproduces the H200's measured need for Triton's default tiles (344,064 bytes at
    bfloat16, head size 64) and picks tiles within its 232,448 bytes."""
    from vlens.attention.flex import SHARED_PER_TILE_BYTE

    assert SHARED_PER_TILE_BYTE * (128 + 2 * 3 * 128) * 64 * 2 == 344_064
    h200 = 232_448
    picks = {(d, size): cuda_tiles(h200, d, size) for d in (64, 128, 256) for size in (2, 4)}
    assert picks[64, 2] == {
        "BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4, "FORCE_USE_FLEX_ATTENTION": True
    }  # fmt: skip
    for (d, size), tiles in picks.items():
        need = SHARED_PER_TILE_BYTE * (tiles["BLOCK_M"] + 2 * tiles["num_stages"] * tiles["BLOCK_N"]) * d * size
        assert need <= h200, (d, size, tiles)


def test_stacked_heads_equal_grouped_query_sdpa():
    """The CUDA path's stacking of query heads (for the memory-efficient kernel), run on the CPU."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((3, 8, 4, 16), (3, 2, 11, 16), (3, 2, 11, 16)))
    key_pos, q_pos = torch.arange(11), torch.tensor([[7, 8, 9, 10], [0, 1, 2, 3], [2, 0, 0, 0]])
    mask = (key_pos <= q_pos[:, None, :, None]) & (key_pos > q_pos[:, None, :, None] - 5)
    layer = KIND._replace(head_dim=16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    stacked = _stacked_mask(mask, 4, torch.float32)
    assert stacked.shape == (3, 1, 16, 11) and stacked.stride(2) == 16  # rows 16-aligned in memory
    got = _stacked(q, k, v, stacked, layer)
    assert rel_err(got, expected) <= 1e-6


def test_sdpa_groups_decodes_by_their_keys():
    """Decodes read every key up to their group's longest context, so decodes of very different lengths
    (ordered longest first) share a call only while the padding stays small; prefill chunks group while
    their queries and their keys are at most half padding, fresh prompts apart from chunks after cached
    keys."""
    from vlens.attention.sdpa import MIN_PADDED_KEYS, _group

    contexts = [400, 390, 385, 300, 290, 60, 50, 40, 8, 5]
    groups = _group([1] * len(contexts), contexts)
    assert [i for g in groups for i in g] == list(range(len(contexts))) and len(groups) > 1
    for g in groups:
        keys = [contexts[i] for i in g]
        assert len(keys) * max(keys) - sum(keys) <= max(MIN_PADDED_KEYS, sum(keys) // 8)
    assert _group([1] * 64, [40 + i % 29 for i in range(64)]) == [list(range(64))]  # similar lengths: one call
    assert _group([1] * 5, None) == [list(range(5))]  # no cache: one key each
    assert _group([9, 8, 1, 1, 2], [9, 8, 30, 500, 2]) == [[0, 1], [2, 3], [4]]  # a few padded keys: one call
    assert _group([16, 12, 12, 12], [16, 12, 12, 12]) == [[0, 1, 2, 3]]  # fresh prompts of alike lengths
    assert _group([16, 12, 12, 12], [216, 12, 12, 12]) == [[0], [1, 2, 3]]  # one with a long cached context
    assert _group([64, 64], [100_000, 64]) == [[0], [1]]  # a pair: half padding alone would join them
    assert _group([12, 10, 9], [40, 30, 9]) == [[0, 1], [2]]  # chunks after cached keys together, not with fresh
    assert _group([16, 12, 12, 12], None) == [[0, 1, 2, 3]]  # no cache: the keys are the queries
    # chunks after long cached contexts: each alone once their call's mask would pass MAX_MASK elements
    assert _group([2048, 2048], [100_000, 100_000]) == [[0], [1]]
    assert _group([200] * 8, [4200] * 8) == [list(range(8))]  # 8 x 200 x 4,200: within
    assert _group([2048, 2048], [2048, 2048]) == [[0, 1]]  # fresh prompts: no mask at all


def test_decodes_of_very_different_lengths_equal_each_served_alone(tmp_path, monkeypatch):
    """A step whose decodes split into several SDPA calls gives each request what it gets alone."""
    from transformers import LlamaConfig

    import vlens.attention.sdpa as sdpa

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    llm = LLM(model=build(config, tmp_path, "llama"), dtype="float32", device="cpu", block_size=8)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (300, 4, 250, 6, 9, 280)]
    capture = Capture(["blocks.1.attn.hook_z", "blocks.1.hook_resid_post"], positions="generated")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=capture)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    calls = []
    group = sdpa._group
    monkeypatch.setattr(sdpa, "_group", lambda q, c: calls.append(group(q, c)) or calls[-1])
    together = llm.generate(prompts, params, use_tqdm=False)
    assert max(len(groups) for groups in calls) > 1  # decodes split into calls by their keys
    for a, b in zip(alone, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for name, rows in a.activations.items():
            assert rel_err(b.activations[name], rows) <= 1e-5, name


def test_prompts_beside_a_long_cached_prefix_equal_each_served_alone(tmp_path, monkeypatch):
    """A prompt whose long prefix is cached takes its own SDPA call, apart from the fresh prompts of its
    step, and every request still gets what it gets alone."""
    from transformers import LlamaConfig

    import vlens.attention.sdpa as sdpa

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    llm = LLM(model=build(config, tmp_path, "llama"), dtype="float32", device="cpu", block_size=8,
              enable_prefix_caching=True)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, VOCAB, (240,), generator=g).tolist()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                            capture=Capture(["blocks.1.hook_resid_post"], positions="generated"))  # fmt: skip
    llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)  # the prefix, cached
    prompts = [prefix + torch.randint(0, VOCAB, (14,), generator=g).tolist()]
    prompts += [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (12, 11, 13)]
    calls = []
    group = sdpa._group
    monkeypatch.setattr(sdpa, "_group", lambda q, c: calls.append((q, group(q, c))) or calls[-1][1])
    together = llm.generate(prompts, params, use_tqdm=False)
    prefill = [(q, groups) for q, groups in calls if max(q) > 1]
    assert [q for q, _ in prefill] == [[14, 13, 12, 11]]  # the prefix's 240 tokens are not computed again
    assert len(prefill[0][1]) > 1  # the cached prefix's prompt apart from the fresh ones
    monkeypatch.setattr(sdpa, "_group", group)
    for prompt, b in zip(prompts, together, strict=True):
        a = llm.generate([prompt], params, use_tqdm=False)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert rel_err(b.activations["blocks.1.hook_resid_post"], a.activations["blocks.1.hook_resid_post"]) <= 1e-5


def test_flashinfer_refuses_float32_and_its_missing_head_sizes_by_name(monkeypatch):
    """FlashInfer's prefill kernels take 16-bit tiles and a few head sizes only: naming it for a float32 model (or
    one with heads of another size) is a ValueError saying so, not a dispatch error from its first plan (nor an
    ImportError here, where it is not installed)."""
    import vlens.attention

    monkeypatch.setattr(vlens.attention, "available_backends", lambda device: ["sdpa", "flex", "flashinfer"])
    with pytest.raises(ValueError, match=r"^attention_backend: 'flashinfer' needs float16 or bfloat16 .*not float32"):
        make_backend("flashinfer", torch.device("cuda"), False, {KIND}, torch.float32, 16)
    # Gemma 4's full layers have heads of 512 dims, which neither FlashInfer nor Flash Attention (varlen) takes:
    # "auto" runs such a model on sdpa
    gemma4 = {KIND._replace(head_dim=256), KIND._replace(head_dim=512, num_kv_heads=1)}
    with pytest.raises(ValueError, match=r"'flashinfer' takes heads of 64, 128, 256 dims, not \[512\]"):
        make_backend("flashinfer", torch.device("cuda"), False, gemma4, torch.bfloat16, 16)
    assert choose(torch.device("cuda"), gemma4, torch.bfloat16, 256)[0] == "sdpa"
    # Llama 4's chunked layers: neither, so "auto" runs it on sdpa too
    llama4 = {KIND._replace(chunk=8192), KIND}
    with pytest.raises(ValueError, match=r"'flashinfer' \(as vlens plans it\) has no chunked attention"):
        make_backend("flashinfer", torch.device("cuda"), False, llama4, torch.bfloat16, 16)
    assert choose(torch.device("cuda"), llama4, torch.bfloat16, 256)[0] == "sdpa"
