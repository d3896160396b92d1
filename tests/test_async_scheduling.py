"""Async scheduling: a decode step queued before the previous step's sampled ids reach the host, its input
ids read on the device (ModelRunner.run_ahead). On a GPU the host plans step N+1 while the device runs step
N; here (the static decode path, graphs emulated on the CPU) the same code runs in the same order, so its outputs
can be checked against the engine with it off — tokens, log-probabilities, captured rows, steered runs —
with requests that end by a stop token mid-run (their queued row is dropped), by length at different steps,
seeded sampling of several samples per request, penalties (which turn it off) and an abort between steps."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from replayed_graphs import replay_graphs
from transformers import LlamaConfig

from vlens import LLM, Capture, SamplingParams, Steer
from vlens.engine.llm_engine import NewRequest

D = COMMON["hidden_size"]


@pytest.fixture(scope="module")
def path(tmp_path_factory, smol_path) -> str:
    """A tiny Llama with SmolLM2's tokenizer (its ids below 300 are text like any other), for streamed
    requests, whose text grows step by step."""
    out = build(LlamaConfig(**COMMON, num_key_value_heads=2), tmp_path_factory.mktemp("async"), "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_path / name, Path(out) / name)
    return out


@pytest.fixture(scope="module")
def engines(path) -> dict[bool, LLM]:
    """The same model with async scheduling on and off, both taking the static decode path; with it on, as
    on a GPU, decode steps replay graphs (emulated: tests/replayed_graphs.py)."""
    out = {}
    for on in (True, False):
        llm = LLM(model=path, dtype="float32", device="cpu", block_size=4, max_num_seqs=8, async_scheduling=on)
        llm.runner.static_decode = True
        if on:
            replay_graphs(llm.runner)
        out[on] = llm
    return out


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 15, (n,), generator=g)
    return [torch.randint(0, COMMON["vocab_size"], (int(k),), generator=g).tolist() for k in lengths]


def _same(a, b) -> None:
    """Two lists of RequestOutputs: the same tokens, ends, positions and log-probability ranks; values within
    1e-5 (a step queued ahead may hold a row more than the synchronous one, which can move a GEMM's last bit)."""
    for x, y in zip(a, b, strict=True):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.finish_reason for c in x.outputs] == [c.finish_reason for c in y.outputs]
        assert [c.stop_reason for c in x.outputs] == [c.stop_reason for c in y.outputs]
        for cx, cy in zip(x.outputs, y.outputs):
            assert (cx.logprobs is None) == (cy.logprobs is None)
            for px, py in zip(cx.logprobs or [], cy.logprobs or [], strict=True):
                assert {t: p.rank for t, p in px.items()} == {t: p.rank for t, p in py.items()}
                assert all(abs(px[t].logprob - py[t].logprob) < 1e-5 for t in px)
        assert x.activations.keys() == y.activations.keys()
        for name in x.activations:
            assert x.activations[name].shape == y.activations[name].shape, name
            assert rel_err(x.activations[name], y.activations[name]) < 1e-5, name
        assert x.activation_positions is None or torch.equal(x.activation_positions, y.activation_positions)


def _both(engines, prompts, params) -> tuple[list, list, int]:
    """(async outputs, sync outputs, steps the async engine queued ahead)."""
    stats = engines[True].runner.graph_stats
    before, replays = stats.ahead_steps, stats.graph_steps
    on = engines[True].generate(prompts, params, use_tqdm=False)
    ahead = stats.ahead_steps - before
    assert stats.graph_steps - replays >= ahead  # every step queued ahead replayed a graph
    off = engines[False].generate(prompts, params, use_tqdm=False)
    assert engines[False].runner.graph_stats.ahead_steps == 0
    return on, off, ahead


def test_captures_steering_and_lengths_match_the_synchronous_engine(engines):
    g = torch.Generator().manual_seed(1)
    capture = Capture(["blocks.1.hook_resid_post", "blocks.0.attn.hook_z", "unembed.hook_out"], positions="generated")
    steer = Steer("blocks.0.hook_resid_post", torch.randn(D, generator=g), scale=4.0)
    kinds = [
        dict(),
        dict(capture=capture),
        dict(capture=Capture(["blocks.2.attn.hook_pattern"], positions="last")),
        dict(interventions=[steer], capture=capture),
        dict(logprobs=3),
    ]
    lengths = [9, 3, 12, 1, 6, 10, 2, 7]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, **kinds[i % len(kinds)])
              for i, m in enumerate(lengths)]  # fmt: skip
    on, off, ahead = _both(engines, _prompts(2, len(params)), params)
    _same(on, off)
    assert ahead >= 5  # the decode run queued its steps ahead, down to the last request
    for out, m in zip(on, lengths):
        assert len(out.outputs[0].token_ids) == m
        if "blocks.1.hook_resid_post" in out.activations:  # one row per generated token but the last
            assert out.activations["blocks.1.hook_resid_post"].shape[0] == m - 1


def test_a_full_batch_runs_ahead_while_requests_wait(engines):
    """20 requests, 8 places: while the batch is full and no place frees, steps are queued ahead; the step
    that ends a request by length is not, so the waiting request takes its place in the next step."""
    lengths = [3 + (7 * i) % 11 for i in range(20)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]
    on, off, ahead = _both(engines, _prompts(6, len(params)), params)
    _same(on, off)
    assert ahead >= 5
    steps = {}
    for on_ in (True, False):  # places are refilled in the same steps: async scheduling delays no admission
        engine, count = engines[on_].engine, 0
        engine.add_requests([NewRequest(p, q) for p, q in zip(_prompts(6, len(params)), params)])
        while engine.has_work():
            engine.step()
            count += 1
        steps[on_] = count
    assert steps[True] == steps[False]


@pytest.mark.parametrize("positions, reduce", [("generated", "none"), ("last", "none"), ("all", "mean")])
def test_a_stop_token_drops_the_row_queued_behind_it(engines, positions, reduce):
    """Request i stops on the token it would sample at step 2 + i % 4: the next, queued ahead with the other
    requests' steps, loses its row — rows at generated positions, the last row (which a newer row would
    push out), a mean summed on the device."""
    prompts = _prompts(3, 6)
    capture = Capture("blocks.1.hook_resid_post", positions=positions, reduce=reduce)
    free = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, capture=capture)] * len(prompts)
    runs = engines[False].generate(prompts, free, use_tqdm=False)
    stops = [SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[o.outputs[0].token_ids[2 + i % 4]],
                             capture=capture) for i, o in enumerate(runs)]  # fmt: skip
    on, off, ahead = _both(engines, prompts, stops)
    _same(on, off)
    assert ahead > 0
    everything = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                capture=Capture("blocks.1.hook_resid_post", positions="all"))  # fmt: skip
    full = engines[False].generate(prompts, everything, use_tqdm=False)
    for out, run, whole in zip(on, runs, full):
        n = run.outputs[0].token_ids.index(out.outputs[0].stop_reason) + 1
        assert out.outputs[0].token_ids == run.outputs[0].token_ids[:n] and out.outputs[0].finish_reason == "stop"
        rows, every = out.activations["blocks.1.hook_resid_post"], whole.activations["blocks.1.hook_resid_post"]
        p = len(out.prompt_token_ids)
        wanted = {"generated": every[p : p + n - 1], "last": every[p + n - 2 : p + n - 1],
                  "all": every[: p + n - 1].double().mean(0, keepdim=True).float()}[positions]  # fmt: skip
        assert rows.shape == wanted.shape and rel_err(rows, wanted) < 1e-5


def test_seeded_samples_match_and_penalties_run_synchronously(engines):
    prompts = _prompts(4, 4)
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=7 + i, n=2, logprobs=2) for i in range(4)]
    on, off, ahead = _both(engines, prompts, seeded)
    _same(on, off)
    assert ahead > 0
    penalised = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.3)] * 4
    on, off, ahead = _both(engines, prompts, penalised)
    _same(on, off)
    assert ahead == 0  # a penalty reads the sampled history, which a queued step would not have


def test_an_abort_between_steps(engines):
    """A request aborted while a step of it is queued ahead: the others end as without async scheduling."""
    prompts = _prompts(5, 4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, capture=Capture("blocks.2.hook_resid_pre"))
    results = {}
    for on, llm in engines.items():
        engine = llm.engine
        ids = engine.add_requests([NewRequest(p, params) for p in prompts])
        for _ in range(4):
            engine.step()
        engine.abort(ids[1])
        done = {}
        while engine.has_work():
            for delta in engine.step():
                if delta.finished:
                    done[delta.request_id] = delta.output
        assert ids[1] not in done and len(done) == 3
        results[on] = [done[i] for i in ids if i != ids[1]]
    _same(results[True], results[False])


def _script(seed: int) -> list[tuple[list[tuple[list[int], SamplingParams, bool]], int | None]]:
    """A seeded serving session: per step, the requests that arrive (prompt, params, streamed) and which
    earlier request, counted in arrival order, is aborted (or None)."""
    g = torch.Generator().manual_seed(seed)
    steer = Steer("blocks.1.hook_resid_post", torch.randn(D, generator=g), scale=3.0)
    kinds = [
        dict(temperature=0, ignore_eos=True),
        dict(temperature=0, ignore_eos=True, capture=Capture(["blocks.0.hook_resid_post", "blocks.2.mlp.hook_post"],
                                                             positions="generated")),  # fmt: skip
        dict(temperature=0, stop_token_ids=[int(t) for t in torch.randint(0, 300, (12,), generator=g)],
             capture=Capture("blocks.1.hook_resid_post", positions="last")),
        dict(temperature=0, ignore_eos=True, interventions=[steer], logprobs=2),
        dict(temperature=0.9, top_p=0.9, seed=11, n=2),
        dict(temperature=0, ignore_eos=True, frequency_penalty=0.5),
        dict(temperature=0, stop=["e", "a"], capture=Capture("blocks.2.hook_resid_pre", positions="generated")),
    ]
    weights = torch.tensor([3.0, 3, 3, 3, 2, 1, 1])  # rarer: penalties and stop strings, which queue nothing ahead
    script, arrived = [], 0
    for step in range(40):
        new = []
        for _ in range(int(torch.randint(0, 3, (), generator=g)) if step < 25 else 0):
            kind = kinds[int(torch.multinomial(weights, 1, generator=g))]
            m = int(torch.randint(1, 20, (), generator=g))
            stream = bool(torch.rand((), generator=g) < 0.3)
            new.append((_prompts(seed * 100 + step, 1)[0], SamplingParams(max_tokens=m, **kind), stream))
        arrived += len(new)
        abort = None
        if arrived and torch.rand((), generator=g) < 0.1:
            abort = int(torch.randint(0, arrived, (), generator=g))
        script.append((new, abort))
    return script


@pytest.mark.parametrize("seed", [0, 1])
def test_a_serving_session_with_arrivals_and_aborts_matches_the_synchronous_engine(engines, seed):
    """Requests of every kind arrive at random steps into a batch of 8 places, some streamed, some aborted
    while a step of theirs may be queued ahead: every request that ends ends as it does without async
    scheduling, and its deltas (step by step where streamed) add up to its tokens."""
    results, aborted = {}, {}
    for on, llm in engines.items():
        engine, ids, done, streamed = llm.engine, [], {}, {}

        def step():
            for delta in engine.step():
                streamed.setdefault((delta.request_id, delta.index), []).extend(delta.token_ids)
                if delta.output is not None:
                    done[delta.request_id] = delta.output

        before = llm.runner.graph_stats.ahead_steps
        for new, abort in _script(seed):
            ids += engine.add_requests([NewRequest(p, q, stream=s) for p, q, s in new])
            if abort is not None:
                engine.abort(ids[abort])
                done.pop(ids[abort], None)
            step()
        while engine.has_work():
            step()
        assert not on or llm.runner.graph_stats.ahead_steps > before
        for (request, index), tokens in streamed.items():
            if request in done:
                assert tokens == done[request].outputs[index].token_ids
        results[on] = [done.get(i) for i in ids]
        aborted[on] = [i is None for i in results[on]]
    assert aborted[True] == aborted[False] and sum(aborted[True]) < len(aborted[True]) - 10
    _same([r for r in results[True] if r is not None], [r for r in results[False] if r is not None])
