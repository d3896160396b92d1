"""The prefix cache of models whose layers keep a state per sequence (vlens.engine.block_manager): a prompt's state
at its last block boundary is kept, and a later prompt that starts with those blocks starts there. Qwen 3.5 (gated
delta nets beside attention), Mamba (no attention: its blocks hold no keys), Bamba (Mamba 2 mixers beside
attention) and LFM2 (short convolutions beside attention), against the same model with the prefix cache off: the
same tokens, every captured row within 1e-5, fewer tokens computed; prompts of one step behind one prefix, chunked
prefill, a cache too small to keep states, and two ranks."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from conftest import rel_err
from family_parity import build, sequences
from replayed_graphs import replay_graphs
from test_parity_bamba import bamba_config
from test_parity_lfm2 import lfm2_config
from test_parity_mamba import mamba_config
from test_parity_qwen3_5 import text_config

from vlens import LLM, Capture, SamplingParams
from vlens.engine.block_manager import SNAPSHOT_BLOCKS

CONFIGS = {"qwen3_5": text_config, "mamba": mamba_config, "bamba": bamba_config, "lfm2": lfm2_config}
BLOCK = 4
HOOKS = ["blocks.0.hook_resid_post", "blocks.2.hook_resid_post", "ln_final.hook_normalized"]


def _open(path: str, **settings) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", block_size=BLOCK, **settings)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(path, an engine with the prefix cache, one without)."""
    path = build(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param), request.param)
    return path, _open(path), _open(path, enable_prefix_caching=False)


def _params(tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                          capture=Capture(hooks=HOOKS, positions="generated"))  # fmt: skip


def _same(got: list, want: list) -> None:
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(rel_err(a.activations[h], b.activations[h]) <= 1e-5 for h in HOOKS)


def _computed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, int]:
    """The outputs, and how many tokens the engine fed through the model for them."""
    before = llm.stats().tokens_computed
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.stats().tokens_computed - before


def _slots_back(llm: LLM) -> None:
    """Every state slot free or keeping a prefix's state, none held or pinned."""
    blocks = llm.engine.blocks
    assert sorted(blocks.free_states + list(blocks.snapshots.values())) == list(range(blocks.num_states))
    assert not blocks.pinned and not blocks.state_of


def test_a_prompt_again_and_a_chat_s_next_turn_start_from_the_kept_state(pair):
    """A 30-token prompt keeps its state at token 28, and its sequence, which computes 35 tokens, its state at 32 (the
    last block boundary a step of it started at): run again, the prompt computes its last 2 tokens; a next turn (the
    prompt, its reply and a new message) starts at 32, inside the reply. Every output is the uncached engine's."""
    _, cached, plain = pair
    cached.reset_prefix_cache()
    prompt = sequences((30,))[0]
    want = plain.generate([prompt], _params(), use_tqdm=False)
    first, fed = _computed(cached, [prompt], _params())
    assert fed == 30 + 5 and cached.stats().kept_states == 2
    again, fed = _computed(cached, [prompt], _params())
    assert fed == 2 + 5 and (first[0].num_cached_tokens, again[0].num_cached_tokens) == (0, 28)
    _same(first + again, want + want)
    turn = prompt + want[0].outputs[0].token_ids + sequences((9,))[0]
    want = plain.generate([turn], _params(), use_tqdm=False)
    got, fed = _computed(cached, [turn], _params())
    assert fed == len(turn) - 32 + 5
    _same(got, want)
    _slots_back(cached)


def test_parallel_samples_start_from_the_first_s_kept_state(pair):
    """n=3 seeded samples of a 30-token prompt: sample 0 computes the prompt and keeps its state at 28, the others
    start there (2 tokens each); every sample is the one its seed gives alone."""
    _, cached, plain = pair
    cached.reset_prefix_cache()
    prompt = sequences((30,))[0]
    got, fed = _computed(cached, [prompt], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7))
    assert fed == 30 + 5 + 2 * (2 + 5)
    for i, sample in enumerate(got[0].outputs):
        alone = plain.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i), use_tqdm=False)
        assert sample.token_ids == alone[0].outputs[0].token_ids, i
    _slots_back(cached)


def test_decode_graphs_copy_the_state_a_next_turn_starts_from(pair):
    """Decode steps replayed from graphs (emulated here: tests/replayed_graphs.py) copy a sequence's state at block
    boundaries outside the graph: the next turn starts inside the reply, with the uncached engine's output."""
    path, _, plain = pair
    graphs = _open(path)
    replay_graphs(graphs.runner)
    prompt = sequences((30,))[0]
    first = graphs.generate([prompt], _params(), use_tqdm=False)
    assert graphs.runner.graph_stats.graph_steps > 0
    turn = prompt + first[0].outputs[0].token_ids + sequences((9,))[0]
    got, fed = _computed(graphs, [turn], _params())
    assert fed == len(turn) - 32 + 5
    _same(got, plain.generate([turn], _params(), use_tqdm=False))


def test_only_prefixes_with_a_kept_state_are_taken(pair):
    """Prompts that share blocks with a cached one but not the block its state was kept after, or whose own last
    block boundary is before SNAPSHOT_BLOCKS blocks, compute from the start; with requests mixed in one batch, each
    output is the uncached engine's."""
    _, cached, plain = pair
    cached.reset_prefix_cache()
    base = sequences((40,))[0]
    cached.generate([base], _params(2), use_tqdm=False)  # (its state kept after 36 tokens)
    early = base[:20] + sequences((12,))[0]  # (shares 5 blocks, not the 9 the state is after)
    short = base[: SNAPSHOT_BLOCKS * BLOCK]  # (its last boundary before its last token: 3 blocks)
    _, fed = _computed(cached, [early], _params(2))
    assert fed == len(early) + 1
    _, fed = _computed(cached, [short], _params(2))
    assert fed == len(short) + 1
    mixed = [base, early, base + sequences((5,))[0], short]
    _same(cached.generate(mixed, _params(), use_tqdm=False), plain.generate(mixed, _params(), use_tqdm=False))
    _slots_back(cached)


def test_prompts_of_one_step_behind_one_prefix_compute_it_once(pair):
    """Prompts that share a 25-token prefix, admitted in one step: the first's chunk ends at the prefix's last block
    boundary (24) with its state kept, and the others wait a step to start there; each output the uncached
    engine's. So with prompt log-probabilities (lm-eval's choices of one question), which the others take from the
    first for the prefix: every one within 1e-5 of the uncached engine's."""
    _, cached, plain = pair
    prefix = sequences((25,))[0]
    prompts = [prefix + tail for tail in sequences((10, 7, 12, 9))]
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for params, decodes in ((_params(2), len(prompts)), (scored, 0)):
        cached.reset_prefix_cache()
        steps = plain.stats().eager_steps
        want = plain.generate(prompts, params, use_tqdm=False)
        assert plain.stats().eager_steps == steps + 1  # (without the cache: all at once, none waits)
        got, fed = _computed(cached, prompts, params)
        assert fed == 24 + sum(len(p) - 24 for p in prompts) + decodes
        if params is scored:
            for a, b in zip(got, want):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
                for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) <= 1e-5 * max(1.0, abs(y[t].logprob)) for t in x)
        else:
            _same(got, want)
    _slots_back(cached)


def test_prompts_of_later_steps_behind_one_prefix_compute_it_twice_at_most(pair):
    """Prompts behind one 26-token prefix, each in a call of its own (a server's requests behind one system prompt):
    the second finds the first's blocks of it cached without a state at their end (24), computes them and keeps its
    state there; the third and later start there. Each output the uncached engine's."""
    _, cached, plain = pair
    cached.reset_prefix_cache()
    prefix = sequences((26,))[0]
    prompts = [prefix + tail for tail in sequences((10, 7, 12, 9))]
    for i, prompt in enumerate(prompts):
        got, fed = _computed(cached, [prompt], _params(2))
        assert fed == (len(prompt) if i < 2 else len(prompt) - 24) + 1, i
        _same(got, plain.generate([prompt], _params(2), use_tqdm=False))
    _slots_back(cached)


def test_chunked_prefill_cuts_a_chunk_where_its_state_is_kept(pair):
    """Prompts fed 8 tokens a step (a chunk cut at the point its state is kept), and prompts that extend them in
    the same call: every output is the uncached engine's, and states are kept."""
    path, _, plain = pair
    prompts = sequences((30, 22, 41))
    prompts += [p + sequences((3,))[0] for p in prompts]
    chunked = _open(path, max_num_batched_tokens=8)
    _same(chunked.generate(prompts, _params(), use_tqdm=False), plain.generate(prompts, _params(), use_tqdm=False))
    assert chunked.stats().kept_states > 0
    _slots_back(chunked)


@pytest.mark.parametrize("name", ["qwen3_5", "mamba"])
def test_a_cache_with_no_spare_state_slot(tmp_path, name):
    """State slots for the 2 sequences that run at once and none spare (and so few KV blocks that sequences are
    preempted): a prompt keeps its state only while a slot is free, a sequence that needs a slot takes a kept
    state's, and every output is the uncached engine's."""
    path = build(CONFIGS[name](), tmp_path, name)
    plain = _open(path, enable_prefix_caching=False)
    per_state = type(plain.runner).bytes_per_state(plain.model)
    share = 2 if type(plain.runner).bytes_per_block(plain.model, BLOCK) else 1  # (the states' part of the budget)
    tight = _open(path, max_num_seqs=2, kv_cache_memory=share * 4 * per_state - 1)
    assert tight.engine.blocks.num_states == 2
    prompts = sequences((30, 22, 41))
    prompts += [p + sequences((3,))[0] for p in prompts]
    _same(tight.generate(prompts, _params(), use_tqdm=False), plain.generate(prompts, _params(), use_tqdm=False))
    _slots_back(tight)


def test_two_ranks_start_from_the_kept_state(tmp_path):
    """Under tensor parallelism each rank keeps its share of the state and starts from it: a prompt again computes
    its last tokens, a next turn starts inside the reply, and every output is one process's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = build(text_config(), tmp_path, "qwen3_5")
        one, two = _open(path), _open(path, tensor_parallel_size=2)
        prompts = sequences((30, 21))
        want = one.generate(prompts, _params(), use_tqdm=False)
        first, _ = _computed(two, prompts, _params())
        again, fed = _computed(two, prompts, _params())
        assert fed == 2 + 1 + 2 * 5
        _same(first + again, want + want)
        turn = prompts[0] + want[0].outputs[0].token_ids + sequences((9,))[0]
        got, fed = _computed(two, [turn], _params())
        assert fed == len(turn) - 32 + 5
        _same(got, one.generate([turn], _params(), use_tqdm=False))
        two.close()
    finally:
        torch.set_num_threads(threads)
    assert not multiprocessing.active_children()
