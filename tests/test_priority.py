"""vLLM's priority scheduling, `LLM(scheduling_policy="priority")`: requests wait in the order of (priority, arrival),
lower first, whenever they arrive; when the KV cache runs out, the running sequence last in that order is
preempted (under first come, first served: the newest); each request's output is what it is under first come,
first served. A priority on an engine that does not schedule by it, or one per prompt too few, is refused by name;
the server's `priority` field (vlens serve --scheduling-policy priority) likewise."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import running_server

from vlens import LLM, SamplingParams
from vlens.engine.llm_engine import NewRequest
from vlens.engine.model_runner import ModelRunner
from vlens.server.config import ServerConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "Hello, my name is", "In 1492, Columbus sailed", "def fibonacci(n):",
           "Once upon a time"]  # fmt: skip


def _engine(path, **settings) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", scheduling_policy="priority", **settings)


def _finish_order(llm: LLM, batches: list[list[tuple[int, int]]]) -> tuple[list[int], dict[int, list[int]]]:
    """Add each batch of (prompt, priority) a step after the one before; the prompts in the order their requests
    finish, and each one's tokens."""
    engine, ids, done = llm.engine, {}, {}

    def step() -> None:
        for delta in engine.step():
            if delta.finished:
                done[ids[delta.request_id]] = delta.output.outputs[0].token_ids

    for batch in batches:
        added = engine.add_requests([NewRequest(llm.tokenizer(PROMPTS[i])["input_ids"], GREEDY, priority=p)
                                     for i, p in batch])  # fmt: skip
        ids |= dict(zip(added, (i for i, _ in batch)))
        step()
    while engine.has_work():
        step()
    return list(done), done


def test_requests_run_by_priority_then_arrival(smol4_path, smol4):
    """One sequence at a time: by (priority, arrival), and a prompt that comes a step later, while the first runs,
    with a lower number than those waiting goes ahead of them."""
    llm = _engine(smol4_path, max_num_seqs=1, kv_cache_memory=16 << 20)
    order, tokens = _finish_order(llm, [[(0, 5), (1, 2), (2, 2), (3, 0)], [(4, 1)]])
    assert order == [3, 4, 1, 2, 0]
    alone = smol4.generate(PROMPTS, GREEDY, use_tqdm=False)  # (first come, first served)
    assert [tokens[i] for i in range(len(PROMPTS))] == [out.outputs[0].token_ids for out in alone]
    # LLM.generate and LLM.chat take one per prompt, as vLLM's; outputs in prompt order
    outs = llm.generate(PROMPTS[:2], GREEDY, priority=[3, -1], use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == [out.outputs[0].token_ids for out in alone[:2]]
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, priority=[7], use_tqdm=False)
    assert chat.outputs[0].token_ids == smol4.chat([{"role": "user", "content": "Hi"}], GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_cache_runs_out_and_the_last_by_priority_is_preempted(smol4_path, smol4, policy):
    """Two sequences that do not both fit the cache, the older of the higher number: under priority it is the one
    preempted, though the step had scheduled it already (it leaves the step again), where first come, first served
    preempts the newer."""
    per_block = ModelRunner.bytes_per_block(smol4.model, 16)
    llm = LLM(model=str(smol4_path), dtype="float32", device="cpu", scheduling_policy=policy, max_num_seqs=2,
              kv_cache_memory=6 * per_block, enable_prefix_caching=False)  # fmt: skip  (96 tokens of KV)
    preempted: list[str] = []
    preempt = llm.engine.scheduler._preempt

    def recording(seq) -> None:
        preempted.append(seq.request_id)
        preempt(seq)

    llm.engine.scheduler._preempt = recording
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine, prompts = llm.engine, [list(range(100, 108)), list(range(300, 314))]
    [old] = engine.add_requests([NewRequest(prompts[0], params, priority=1 if policy == "priority" else 0)])
    done = {d.request_id: d.output.outputs[0].token_ids for d in engine.step() if d.finished}
    [new] = engine.add_requests([NewRequest(prompts[1], params)])  # (a step later: running after the old one)
    while engine.has_work():
        done |= {d.request_id: d.output.outputs[0].token_ids for d in engine.step() if d.finished}
    assert preempted and preempted[0] == (old if policy == "priority" else new)
    alone = smol4.generate(prompts, params, use_tqdm=False)
    assert [done[old], done[new]] == [out.outputs[0].token_ids for out in alone]


def test_a_priority_is_refused_where_it_cannot_order(smol4, smol4_path):
    with pytest.raises(ValueError, match=r"^priority: 2 orders requests under scheduling_policy='priority'"):
        smol4.generate(PROMPTS[:2], GREEDY, priority=[0, 2], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^priority: got \[1\] for 2 prompts; give one int per prompt"):
        smol4.generate(PROMPTS[:2], GREEDY, priority=[1], use_tqdm=False)
    assert not smol4.engine.has_work()
    with pytest.raises(ValueError, match="scheduling_policy"):  # (before the model is loaded)
        LLM(model=str(smol4_path), scheduling_policy="lifo")


def test_the_servers_priority_field(smol4_path, smol4):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    [want] = smol4.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with running_server(_engine(smol4_path, kv_cache_memory=16 << 20), ServerConfig()) as url:
        out = httpx.post(url + "/v1/completions", json=body | {"priority": -3}, timeout=60)
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == want.outputs[0].text
        embedded = httpx.post(url + "/v1/embeddings", json={"input": "Hi", "priority": -3}, timeout=60)
        assert embedded.status_code == 200, embedded.text
    with running_server(smol4, ServerConfig()) as url:
        refused = httpx.post(url + "/v1/completions", json=body | {"priority": 2}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
        assert httpx.post(url + "/v1/completions", json=body | {"priority": 0}, timeout=60).status_code == 200
        refused = httpx.post(url + "/v1/embeddings", json={"input": "Hi", "priority": 2}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
