"""Tensor parallelism on the CPU (gloo, two ranks: this process and one worker, one thread each): every
hook of a packed trace and of a generation equals the one-process value within 1e-5 (float32; the
row-parallel sums add the ranks' partial products in another order, so not bit for bit), greedy tokens
are the same, interventions on sharded and replicated taps act as in one process, bad sizes are refused
before a weight loads, a rank killed mid-generation fails the caller at once with its name and
leaves no process behind, and a hook function that raises on rank 0 fails only the call, with its own
exception, leaving the group usable.

One tiny random checkpoint per family, one one-process and one two-rank LLM per family (a process
joins one group at a time, so each family's group is closed before the next starts)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import torch
from family_parity import COMMON, VOCAB, build, sequences
from harvest_helpers import read_shards, write_jsonl
from hf_reference import same
from sae_helpers import save_saelens
from server_helpers import vlens_serve
from test_parity_bamba import bamba_config
from test_parity_bloom import CONFIGS as BLOOM_CONFIGS
from test_parity_gemma4 import CONFIGS as GEMMA4_CONFIGS
from test_parity_gpt_oss import CONFIGS as GPT_OSS_CONFIGS
from test_parity_granite import hybrid_config as granite_hybrid_config
from test_parity_lfm2 import lfm2_config
from test_parity_moe import CONFIGS as MOE_CONFIGS
from test_parity_qwen3_5 import next_config
from test_parity_qwen3_5 import text_config as qwen3_5_config
from transformers import Gemma2Config, GPT2Config, LlamaConfig, Olmo2Config, Phi3Config, PhiConfig, Qwen2Config

from vlens import LLM, SAE, Ablate, Capture, Clamp, HookedLM, Patch, SamplingParams, Steer, TunedLens, harvest
from vlens.capture.names import mlp_input
from vlens.distributed.parallel import GroupError
from vlens.engine.llm_engine import NewRequest
from vlens.harvest.stats import ShardStats
from vlens.harvest.writer import Store, read_replies

TOL = 1e-5
N = 2
GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
QWEN_LAYERS = ["full_attention"] * 3 + ["linear_attention"]
GPT2 = {"vocab_size": VOCAB + 1, "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 128, "initializer_range": 0.1}

CONFIGS = {
    "smollm2": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),  # GQA, tied
    "qwen2_mqa": lambda: Qwen2Config(**COMMON, num_key_value_heads=1),  # biases; one KV head on both ranks
    "gemma2": lambda: Gemma2Config(
        **COMMON,
        num_key_value_heads=2,
        head_dim=24,
        sliding_window=7,
        layer_types=GEMMA_LAYERS,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    # fused Conv1D qkv, LayerNorm, learned positions; an odd vocabulary (GPT-2's own is): the last shard is short
    "gpt2": lambda: GPT2Config(**GPT2),
    "mixtral": MOE_CONFIGS["mixtral"],
    # a split shared expert, and a dense layer among the MoE ones
    "qwen2_moe": MOE_CONFIGS["qwen2_moe"],
    # q/k/v and gate/up stored fused: each rank reads its rows of one checkpoint tensor
    "phi3": lambda: Phi3Config(**COMMON, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # q and k normalised over all heads at once: each rank's sum of squares added to the other's (the one KV head
    # on both ranks counted once), post-norms only
    "olmo2_mqa": lambda: Olmo2Config(**COMMON, num_key_value_heads=1),
    # the unembedding's bias split by vocabulary rows as its weight is; one norm for both sublayers
    "phi": lambda: PhiConfig(**COMMON, hidden_act="gelu_new", pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # each rank's heads' sinks; experts' interleaved gate/up columns split, their down bias added once
    "gpt_oss": GPT_OSS_CONFIGS["gpt_oss"],
    # layers of two head sizes: the sliding ones' two key-value heads split, the full ones' one replicated; experts
    # beside the MLP, each rank its columns of their stacked checkpoint tensors
    "gemma4": GEMMA4_CONFIGS["gemma4_experts"],
    # each rank's heads' ALiBi slopes (six heads: both of HF's slope schemes, split three and three)
    "bloom": BLOOM_CONFIGS["bloom_six_heads"],
    # gated attention heads (each head's query and gate rows split together), then a gated delta net: each rank its
    # key heads and the value heads they serve, their rows of every projection and of the convolution, their states
    "qwen3_5": lambda: qwen3_5_config(num_hidden_layers=4, layer_types=QWEN_LAYERS),
    # the same with experts, a dense layer among them, and the linear layer's projections stored grouped by key head
    "qwen3_next": lambda: next_config(num_hidden_layers=4, layer_types=QWEN_LAYERS),
    # LFM2: a short convolution after three attention layers, each rank its channels of B, C, x and the convolution
    "lfm2": lambda: lfm2_config(num_hidden_layers=4, layer_types=["full_attention"] * 3 + ["conv"]),
    # a Mamba 2 mixer after three attention layers: each rank its heads and its one of the two groups of B and C
    "bamba": lambda: bamba_config(num_hidden_layers=4, attn_layer_indices=[0, 1, 2]),
    # Granite 4.0: the same with one group, which both ranks hold, its norm's sums of squares added over the ranks
    "granite_hybrid": lambda: granite_hybrid_config(num_hidden_layers=4, layer_types=QWEN_LAYERS),
}


def _open(path: str, **settings) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", block_size=4, **settings)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take the thread count of rank 0
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory, one_thread):
    """(name, one-process LLM, two-rank LLM) of one family."""
    path = build(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param), request.param)
    two = _open(path, tensor_parallel_size=N)
    yield request.param, _open(path), two
    two.close()
    assert not multiprocessing.active_children()


def test_bad_sizes_are_refused_before_loading(tmp_path):
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    before = set(multiprocessing.active_children())  # another module-scoped group may still run
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide num_attention_heads=4.*\[1, 2, 4\]"):
        _open(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _open(path, tensor_parallel_size=0)
    assert set(multiprocessing.active_children()) == before  # no worker was started


def test_killed_rank_fails_the_caller_and_leaves_nothing(tmp_path, one_thread):
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    before = set(multiprocessing.active_children())
    llm = _open(path, tensor_parallel_size=N)
    executor = llm.model.executor
    victim = executor.ranks.procs[0]
    engine = llm.engine
    engine.add_requests([NewRequest(p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
                         for p in sequences((30, 20, 10))])  # fmt: skip
    for _ in range(3):
        engine.step()  # generation is under way on both ranks
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            while engine.has_work():
                engine.step()
        except BaseException as e:  # noqa: BLE001 - whatever it is, the test inspects it
            outcome.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the engine hangs on a dead rank"
    assert len(outcome) == 1 and isinstance(outcome[0], GroupError), outcome
    assert "rank 1" in str(outcome[0]) and str(-signal.SIGKILL) in str(outcome[0])
    assert executor.closed and set(multiprocessing.active_children()) == before
    with pytest.raises(GroupError, match="closed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_worker_that_dies_before_joining_fails_the_start(tmp_path):
    """A worker that dies before it joins the group (here: the spawned worker re-runs a script that has no
    `if __name__ == "__main__":` guard, and dies starting a process of its own) fails `LLM()` with a
    GroupError naming the rank, rather than a rendezvous timeout two minutes later that names nothing."""
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    script = tmp_path / "unguarded.py"
    script.write_text(f"from vlens import LLM\nLLM({path!r}, dtype='float32', device='cpu', tensor_parallel_size=2)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 1
    assert "GroupError: tensor parallel rank 1 did not start: rank 1 exited with code 1" in done.stderr, done.stderr


def test_smollm2_weights_on_three_ranks(smol4, smol4_path):
    """SmolLM2's own weights (cut to four layers): 9 heads and 3 KV heads on three ranks, one KV head each;
    every hook of a trace, and a greedy generation with its hidden states, as in one process. Leaving the
    `with` block ends the group: the LLM refuses to run, and another group can start."""
    texts = ["The capital of France is", "Tensor parallelism splits"]
    settings = dict(model=str(smol4_path), dtype="float32", device="cpu", kv_cache_memory=64 << 20)
    with LLM(**settings, tensor_parallel_size=3) as three:
        hooks = list(smol4.hook_names())
        for a, b in zip(smol4.trace(texts, hooks), three.trace(texts, hooks)):
            assert [h for h in hooks if not _equal(b[h], a[h], h)] == []
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks="hidden_states.*"))
        _check_outputs(smol4.generate(texts, params, use_tqdm=False), three.generate(texts, params, use_tqdm=False))
    three.close()  # (again: nothing to do)
    with pytest.raises(GroupError, match="closed; create a new LLM"):
        three.trace(texts, "hook_embed")
    again = LLM(**settings, tensor_parallel_size=3)
    try:
        [embedded] = again.trace(texts[:1], "hook_embed")
        assert torch.equal(embedded["hook_embed"], smol4.trace(texts[:1], "hook_embed")[0]["hook_embed"])
    finally:
        again.close()


def test_hooked_lm_runs_python_hooks_on_rank_0(smol4_path):
    """run_with_hooks: each function runs once, on rank 0, on the whole tensor (all 9 heads of hook_z, which
    three ranks hold); what it returns reaches every rank. Logits and cache as in one process."""
    one = HookedLM(str(smol4_path), dtype="float32", device="cpu")
    three = HookedLM(str(smol4_path), dtype="float32", device="cpu", tensor_parallel_size=3)
    try:
        vector = torch.randn(one.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        seen = []

        def ablate(z, hook):
            seen.append(tuple(z.shape))
            z = z.clone()
            z[:, :, 4] = 0.0  # a head of the middle rank
            return z

        hooks = [("blocks.1.attn.hook_z", ablate), ("blocks.2.hook_resid_post", lambda x, hook: x + vector)]
        texts = ["The capital of France is", "Tensor parallelism"]
        a, b = one.run_with_hooks(texts, fwd_hooks=hooks), three.run_with_hooks(texts, fwd_hooks=hooks)
        assert seen[0] == seen[1] and seen[0][2] == one.cfg.num_heads
        assert same(b.double(), a.double(), TOL)
        assert not same(one.run_with_hooks(texts).double(), a.double(), 1e-3)  # the hooks took
        names = ["blocks.1.attn.hook_z", "blocks.3.hook_resid_post"]
        (_, cache_a), (_, cache_b) = (
            one.run_with_cache(texts, names_filter=names),
            three.run_with_cache(texts, names_filter=names),
        )
        assert all(same(cache_b[n].double(), cache_a[n].double(), TOL) for n in names)
        with pytest.raises(ValueError, match=r"^gradients: .* one process \(tensor_parallel_size=1\)"):
            three.run_with_cache(texts, names_filter=names, return_type="loss", incl_bwd=True)
        assert same(three.run_with_hooks(texts, fwd_hooks=hooks).double(), a.double(), TOL)  # the group goes on
        # hook points as attributes (TransformerLens's module tree); the weights there need one process
        point = three.blocks[1].attn.hook_z
        point.add_hook(ablate)
        three.blocks[2].hook_resid_post.add_hook(lambda x, hook: x + vector)
        try:
            assert same(three(texts).double(), a.double(), TOL)
        finally:
            three.reset_hooks()
        with pytest.raises(ValueError, match=r"^tensor_parallel_size: 3: the weight attributes \(W_U, W_O, \.\.\.\)"):
            three.blocks[1].attn.W_O
        # TransformerLens's optional hooks, whole on rank 0: a head of the middle rank's output and query input
        for model in (one, three):
            model.set_use_attn_result(True)
            model.set_use_split_qkv_input(True)
        def on_head(head: int, change):
            def fn(value, hook):
                value = value.clone()
                value[:, :, head] = change(value[:, :, head])
                return value

            return fn

        optional = [("blocks.1.attn.hook_result", on_head(4, lambda v: 3 * v)),
                    ("blocks.2.hook_q_input", on_head(5, lambda v: v + vector)),
                    ("blocks.0.hook_k_input", on_head(2, torch.zeros_like))]  # fmt: skip
        a, b = one.run_with_hooks(texts, fwd_hooks=optional), three.run_with_hooks(texts, fwd_hooks=optional)
        assert same(b.double(), a.double(), TOL) and not same(one.run_with_hooks(texts).double(), a.double(), 1e-3)
        names = ["blocks.1.attn.hook_result", "blocks.2.hook_q_input", "blocks.0.hook_v_input"]
        (_, cache_a), (_, cache_b) = (model.run_with_cache(texts, names_filter=names) for model in (one, three))
        assert all(cache_b[n].shape == cache_a[n].shape and same(cache_b[n].double(), cache_a[n].double(), TOL)
                   for n in names)  # fmt: skip
    finally:
        three.llm.close()


def test_harvest_shards_equal_one_process(tmp_path):
    """`harvest(path, tensor_parallel_size=2)` starts a group and closes it when done. hook_embed is byte
    for byte the one-process value (the vocabulary shards add exact zeros); the rows behind a row-parallel
    sum (residual, z) are within 1e-5, also under a harvest's edits: a steer of the residual, and an ablation of
    one rank's head at the sharded hook_z that a hook also reads there."""
    config = CONFIGS["smollm2"]()
    path = build(config, tmp_path, "smollm2")
    before = set(multiprocessing.active_children())
    source = write_jsonl(tmp_path / "tok.jsonl", sequences((40, 30, 50)), field="tokens")
    hooks = ["hook_embed", "blocks.1.hook_resid_post", "blocks.2.attn.hook_z", "blocks.0.mlp.hook_post",
             "blocks.1.attn.hook_result", "blocks.0.hook_mlp_in"]  # fmt: skip  (TransformerLens's optional ones too)
    vector = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(0))
    steer = Steer("blocks.0.hook_resid_post", vector)
    edits = [steer, Ablate("blocks.2.attn.hook_z", heads=[config.num_attention_heads - 1])]
    options = {"context_size": 16, "dtype": "float32", "model_dtype": "float32", "device": "cpu", "progress": False,
               "interventions": edits}  # fmt: skip
    harvest(path, source, hooks, tmp_path / "one", **options)
    harvest(path, source, hooks, tmp_path / "two", tensor_parallel_size=N, **options)
    assert set(multiprocessing.active_children()) == before
    one, two = read_shards(tmp_path / "one"), read_shards(tmp_path / "two")
    assert one.keys() == two.keys() and torch.equal(one["token_ids"], two["token_ids"])
    assert torch.equal(one["hook_embed"], two["hook_embed"])
    for hook in hooks[1:]:
        assert same(two[hook].double(), one[hook].double(), TOL), hook
    assert not two["blocks.2.attn.hook_z"][:, -1].any()
    with pytest.raises(ValueError, match=r"model\.tensor_parallel_size: None on disk, 2 now"):  # not mixed
        harvest(path, source, hooks, tmp_path / "one", tensor_parallel_size=N, **options)


def test_a_generating_harvest_equals_one_process(tmp_path):
    """`generate_tokens` with tensor_parallel_size=2: the engine the harvest starts (and closes) writes the
    one-process continuations, greedy token for token, and the rows over them are within 1e-5."""
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    before = set(multiprocessing.active_children())
    source = write_jsonl(tmp_path / "tok.jsonl", sequences((20, 12, 30)), field="tokens")
    hooks = ["blocks.1.hook_resid_post", "blocks.2.attn.hook_z"]
    options = {"context_size": 16, "dtype": "float32", "model_dtype": "float32", "device": "cpu", "progress": False,
               "generate_tokens": 6}  # fmt: skip
    harvest(path, source, hooks, tmp_path / "one", **options)
    harvest(path, source, hooks, tmp_path / "two", tensor_parallel_size=N, **options)
    assert set(multiprocessing.active_children()) == before
    replies = read_replies(Store.open(tmp_path / "one"))
    assert len(replies) == 3 and all(replies) and read_replies(Store.open(tmp_path / "two")) == replies
    one, two = read_shards(tmp_path / "one"), read_shards(tmp_path / "two")
    assert torch.equal(one["token_ids"], two["token_ids"])
    assert all(same(two[h].double(), one[h].double(), TOL) for h in hooks)


def test_ray_actors_as_ranks(tmp_path):
    """distributed_executor_backend="ray": rank 1 is a Ray actor; the same values as one process, and an
    actor that dies fails the next call with its rank named."""
    ray = pytest.importorskip("ray")
    path = build(CONFIGS["qwen2_mqa"](), tmp_path, "qwen2_mqa")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        one, two = _open(path), _open(path, tensor_parallel_size=N, distributed_executor_backend="ray")
        hooks, seqs = list(one.hook_names()), sequences()
        for a, b in zip(one.trace(seqs, hooks), two.trace(seqs, hooks)):
            assert all(_equal(b[h], a[h], h) for h in hooks)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks[:20]))
        prompts = sequences((9, 4))
        _check_outputs(_generate(one, prompts, params), _generate(two, prompts, params))
        ray.kill(two.model.executor.ranks.actors[0])
        with pytest.raises(GroupError, match="rank 1"):
            _generate(two, prompts, params)
        assert two.model.executor.closed
    finally:
        ray.shutdown()


def test_interrupted_forward_ends_the_group(tmp_path, monkeypatch):
    """A forward that fails on rank 0 half way (an interrupt, out of memory) leaves the other rank in a
    collective: the group is ended rather than fed the next forward out of step."""
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    before = set(multiprocessing.active_children())
    llm = _open(path, tensor_parallel_size=N)
    norm = type(llm.model.final_norm)
    calls, forward = [], norm.forward

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # layer 0's second norm: rank 1 goes on to the MLP's all-reduce and waits there
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(norm, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.trace([[1, 2, 3]], hooks=["ln_final.hook_out"])
    assert llm.model.executor.closed and set(multiprocessing.active_children()) == before
    with pytest.raises(GroupError, match="closed"):
        llm.trace([[1, 2, 3]], hooks=["blocks.0.hook_resid_post"])


def test_failure_after_the_workers_were_sent_the_forward_ends_the_group(tmp_path, monkeypatch):
    """Once the other ranks have the forward, a failure on rank 0 before its own forward starts (an interrupt
    while it sets the forward's context up) leaves them in a collective too: the group is ended, else the
    next forward would pair with theirs."""
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    before = set(multiprocessing.active_children())
    llm = _open(path, tensor_parallel_size=N)

    def interrupted(taps, cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr("vlens.engine.model_runner.shard_taps", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.trace([[1, 2, 3]], hooks=["blocks.0.hook_resid_post"])
        assert llm.model.executor.closed and set(multiprocessing.active_children()) == before
    finally:
        llm.close()


class Boom(Exception):
    """An error of the user's own, of a type vlens knows nothing of."""


def test_hook_function_that_raises_fails_the_call_and_keeps_the_group(tmp_path):
    """A run_with_hooks function raises on rank 0, the one place it runs (at a sharded site, at one every rank
    holds, after edits in the same forward reached every rank, at the logits after the last collective; an
    interrupt; a result of the wrong shape): the call fails with that very exception, as in one process, and
    every rank leaves the forward there, so the group goes on: the same worker, and run_with_hooks and
    generate give the values they gave before, those of one process."""
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    one = HookedLM(path, dtype="float32", device="cpu", block_size=4)
    two = HookedLM(path, dtype="float32", device="cpu", block_size=4, tensor_parallel_size=N)
    try:
        executor = two.llm.model.executor
        worker = executor.ranks.procs[0]
        tokens, mask = torch.tensor(sequences((9, 9))), torch.arange(9) < torch.tensor([[9], [5]])
        vector = torch.randn(one.cfg.hidden_size, generator=torch.Generator().manual_seed(0))

        def ablate(z, hook):
            z = z.clone()
            z[:, :, one.cfg.num_heads - 1] = 0.0  # a head of rank 1
            return z

        edits = [("blocks.0.attn.hook_z", ablate), ("blocks.1.hook_resid_post", lambda x, hook: x + vector)]

        def run(model: HookedLM, hooks=edits) -> torch.Tensor:
            return model.run_with_hooks(tokens, fwd_hooks=hooks, attention_mask=mask)

        expected, before = run(one), run(two)
        assert same(before.double(), expected.double(), TOL)
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                capture=Capture(hooks=["blocks.*.attn.hook_z", "blocks.2.hook_resid_post"]))  # fmt: skip
        prompts = sequences((9, 5))
        generated = _generate(one.llm, prompts, params)
        raised: list[BaseException] = []

        def boom(x, hook):
            raised.append(Boom(f"no good at {hook.name}"))
            raise raised[-1]

        def interrupt(x, hook):
            raise KeyboardInterrupt

        failing = [
            (Boom, r"no good at blocks\.1\.attn\.hook_z", [("blocks.1.attn.hook_z", boom)]),
            (Boom, r"no good at blocks\.0\.hook_resid_post", [("blocks.0.hook_resid_post", boom)]),
            (Boom, r"no good at blocks\.2\.mlp\.hook_post", [*edits, ("blocks.2.mlp.hook_post", boom)]),
            (Boom, r"no good at unembed\.hook_out", [("unembed.hook_out", boom)]),
            (KeyboardInterrupt, None, [("blocks.1.hook_resid_mid", interrupt)]),
            (ValueError, r"fwd_hooks: the function at blocks\.1\.attn\.hook_v returned \(2, 1",
             [("blocks.1.attn.hook_v", lambda v, hook: v[:, :1])]),
        ]  # fmt: skip
        for kind, message, hooks in failing:
            for model in (one, two):
                with pytest.raises(kind, match=message) as info:
                    run(model, hooks)
                if kind is Boom:
                    assert info.value is raised[-1]
            assert not executor.closed and worker.is_alive(), message
            assert torch.equal(run(two), before), message
        _check_outputs(generated, _generate(two.llm, prompts, params))
        assert executor.ranks.procs == [worker]
    finally:
        two.llm.close()


def test_hook_result_the_other_ranks_cannot_take_fails_the_call_alone(tmp_path):
    """A function at a hook (here a harvest-like one on the runner itself) that returns a tensor of another
    dtype or shape than its input: rank 0 refuses it before the broadcast, which the other ranks could not
    pair with, so the call fails naming both and the group goes on."""
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    llm = _open(path, tensor_parallel_size=N)
    try:
        seqs, hook = sequences((6, 3)), "blocks.1.attn.hook_z"
        before = llm.trace(seqs, hook)
        for wrong, what in ((lambda z: z.double(), r"torch\.float64 tensor of shape \(9, 4, 16\)"),
                            (lambda z: z[:, :2], r"torch\.float32 tensor of shape \(9, 2, 16\)")):  # fmt: skip
            refused = what + r" on cpu; under tensor parallelism .*torch\.float32, \(9, 4, 16\)"
            with pytest.raises(ValueError, match=refused):
                llm.runner.packed(seqs, [], hooks={hook: wrong})
            assert not llm.model.executor.closed
        assert all(torch.equal(a[hook], b[hook]) for a, b in zip(before, llm.trace(seqs, hook)))
    finally:
        llm.close()


def test_harvest_row_taker_that_raises_keeps_the_group(tmp_path, monkeypatch):
    """A harvest's row takers run on rank 0 as hook functions do: one that fails (here while it folds the
    statistics of a later shard) fails the harvest with its own error, the LLM it ran on stays usable, and the
    re-run resumes into the shards of one process."""
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    one, two = _open(path), _open(path, tensor_parallel_size=N)
    try:
        source = write_jsonl(tmp_path / "tok.jsonl", sequences((40, 30, 50)), field="tokens")
        hooks = ["blocks.1.hook_resid_post", "blocks.2.attn.hook_z"]
        options = {"context_size": 16, "dtype": "float32", "batch_tokens": 32, "shard_bytes": 20000, "progress": False}
        harvest(one, source, hooks, tmp_path / "one", **options)
        add, calls = ShardStats.add, []

        def failing(self, rows):
            calls.append(1)
            if len(calls) == 5:
                raise Boom("statistics")
            add(self, rows)

        with monkeypatch.context() as patched:
            patched.setattr(ShardStats, "add", failing)
            with pytest.raises(Boom, match="statistics"):
                harvest(two, source, hooks, tmp_path / "two", **options)
        assert not two.model.executor.closed
        assert 0 < len(json.loads((tmp_path / "two" / "manifest.json").read_text())["shards"])
        harvest(two, source, hooks, tmp_path / "two", **options)
        a, b = read_shards(tmp_path / "one"), read_shards(tmp_path / "two")
        assert a.keys() == b.keys() and torch.equal(a["token_ids"], b["token_ids"])
        assert all(same(b[h].double(), a[h].double(), TOL) for h in hooks)
    finally:
        two.close()


def test_server_answers_503_and_exits_nonzero_when_a_rank_dies(tmp_path):
    path = build(CONFIGS["smollm2"](), tmp_path, "smollm2")
    args = ["--model", path, "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", str(N),
            "--kv-cache-memory", str(16 << 20), "--max-model-len", "64"]  # fmt: skip
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0}
    with vlens_serve(args, env={"OMP_NUM_THREADS": "1"}) as (url, proc):
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        children = psutil.Process(proc.pid).children()  # the fork server, multiprocessing's resource tracker
        (server,) = [c for c in children if "forkserver" in " ".join(c.cmdline())]
        (worker,) = server.children()
        worker.kill()
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:  # the server reaps it later
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
        assert proc.wait(timeout=60) == 1, proc.output()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive


def _equal(a: torch.Tensor, b: torch.Tensor, hook: str) -> bool:
    if hook.endswith(("hook_expert_ids", "hook_expert_indices")):
        return torch.equal(a, b)
    return same(a.double(), b.double(), TOL)


def test_shards_are_halves(pair):
    """Each rank holds half the heads, half the MLP columns and half the vocabulary, read from the file."""
    _, one, two = pair
    cfg = one.config
    assert two.model.cfg.parallel.size == N and two.model.cfg.parallel.rank == 0
    attn = two.model.attention_layers()[0]
    assert attn.num_heads == cfg.num_heads // N
    assert attn.num_kv_heads == max(1, cfg.num_kv_heads // N)
    assert two.model.lm_head.weight.shape[0] == -(-cfg.vocab_size // N)
    full, half = one.model.lm_head.weight, two.model.lm_head.weight
    assert torch.equal(half, full[: half.shape[0]])
    own = sum(p.numel() for p in two.model.parameters())
    assert own < 0.7 * sum(p.numel() for p in one.model.parameters())


def test_trace_every_hook_equals_one_process(pair):
    _, one, two = pair
    hooks = list(one.hook_names())
    seqs = sequences()
    failures = []
    for ids, a, b in zip(seqs, one.trace(seqs, hooks), two.trace(seqs, hooks)):
        for hook in hooks:
            assert a[hook].shape == b[hook].shape, hook
            if not _equal(b[hook], a[hook], hook):
                failures.append((len(ids), hook))
    assert not failures, failures


def _generate(llm: LLM, prompts, params) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def _check_outputs(a_outs, b_outs) -> None:
    failures = []
    for a, b in zip(a_outs, b_outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert a.activations.keys() == b.activations.keys()
        for hook, value in a.activations.items():
            if value.shape != b.activations[hook].shape or not _equal(b.activations[hook], value, hook):
                failures.append(hook)
    assert not failures, failures


def test_generation_captures_every_hook_at_every_position(pair):
    _, one, two = pair
    params = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=list(one.hook_names()), positions="all")
    )
    prompts = sequences((20, 9, 3))
    _check_outputs(_generate(one, prompts, params), _generate(two, prompts, params))


def test_static_decode_step_equals_one_process(pair):
    """The padded fixed-shape decode step (the one CUDA graphs replay; run eagerly here) on two ranks."""
    _, one, two = pair
    params = SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True,
        capture=Capture(hooks=["blocks.*.attn.hook_z", "blocks.*.hook_resid_post", "blocks.0.attn.hook_pattern"]),
        interventions=[Steer("blocks.1.attn.hook_v", torch.ones(one.config.num_kv_heads * one.config.head_dim))],
    )  # fmt: skip
    prompts = sequences((7, 3, 5))
    default = two.runner.static_decode, two.runner.pad_decode
    two.runner.static_decode = two.runner.pad_decode = True
    try:
        static = _generate(two, prompts, params)
    finally:
        two.runner.static_decode, two.runner.pad_decode = default
    assert two.runner.graph_stats.static_eager_steps > 0
    _check_outputs(_generate(one, prompts, params), static)


def _interventions(llm: LLM) -> list[list]:
    """Per request: steered (residual), ablated (MLP out), per-head steered and ablated (heads on both
    ranks, at the sharded hook_z), a steer and a patch on sharded MLP columns / KV heads, and none."""
    cfg, shapes = llm.config, llm.hook_names()
    g = torch.Generator().manual_seed(3)
    d, dh = cfg.hidden_size, cfg.head_dim
    heads = [0, cfg.num_heads - 1]  # one on each rank
    mlp = "blocks.1.mlp.hook_post" if "blocks.1.mlp.hook_post" in shapes else "blocks.1.mlp.hook_router_logits"
    return [
        [Steer("blocks.1.hook_resid_post", torch.randn(d, generator=g), scale=2.0)],
        [Ablate("blocks.{0,2}.hook_mlp_out", torch.randn(d, generator=g))],
        [
            Steer("blocks.0.attn.hook_z", torch.randn(len(heads), dh, generator=g), heads=heads),
            Ablate("blocks.2.attn.hook_z", heads=[1]),
        ],
        [
            Steer(mlp, torch.randn(shapes[mlp][0], generator=g), positions="generated"),
            Patch("blocks.1.attn.hook_v", torch.randn(cfg.num_kv_heads * dh, generator=g), positions=[2, 5]),
            Ablate("blocks.0.attn.hook_q", torch.randn(cfg.num_heads * dh, generator=g)),
        ],
        [],
    ]


def test_mixed_batch_of_interventions_equals_one_process(pair):
    _, one, two = pair
    hooks = ["blocks.*.hook_resid_post", "blocks.*.attn.hook_z", "blocks.1.attn.hook_v"]
    prompts = sequences((12, 9, 7, 10, 5))
    params = [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, interventions=ivs, capture=Capture(hooks=hooks))
        for ivs in _interventions(one)
    ]
    a, b = _generate(one, prompts, params), _generate(two, prompts, params)
    _check_outputs(a, b)
    # the edits took: every steered request differs from the plain one's path
    plain_params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
    plain = _generate(one, prompts[:1], [plain_params])
    resid = "blocks.2.hook_resid_post"
    assert not torch.equal(plain[0].activations[resid], a[0].activations[resid])


def test_sae_clamp_on_a_sharded_hook_and_features_of_the_residual(pair, tmp_path):
    """A Clamp at hook_z (split by heads: the SAE encodes the whole gathered row) and an SAE's top latents
    of the residual (read once, on rank 0): as in one process."""
    _, one, two = pair
    shapes = one.hook_names()
    z, resid = "blocks.1.attn.hook_z", "blocks.1.hook_resid_post"
    sae_z = SAE.load(save_saelens(tmp_path / "z", d_sae=32, hook=z, d_in=math.prod(shapes[z]))[0])
    sae_r = SAE.load(save_saelens(tmp_path / "r", "jumprelu", d_sae=32, hook=resid, d_in=shapes[resid][0])[0])
    clamp = {
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "interventions": [Clamp(z, sae_z, feature=3, value=4.0)],
    }
    params = [
        SamplingParams(**clamp, capture=Capture(hooks=[z, resid])),
        SamplingParams(**clamp, capture=Capture(sae=sae_r, top_k=4)),
    ]
    prompts = sequences((9, 6))
    a, b = _generate(one, prompts, params), _generate(two, prompts, params)
    _check_outputs(a, b)
    (ids_a, values_a), (ids_b, values_b) = a[1].sae_features[resid], b[1].sae_features[resid]
    assert torch.equal(ids_a, ids_b) and same(values_b.double(), values_a.double(), TOL)
    clamp.pop("interventions")
    unclamped = _generate(one, prompts[:1], [SamplingParams(**clamp, capture=Capture(hooks=[z]))])
    assert not same(unclamped[0].activations[z].double(), a[0].activations[z].double(), 1e-3)  # the clamp took


def test_transcoder_clamps_read_where_they_read_also_from_a_sharded_hook(pair):
    """Clamps of two transcoders — the MLP's input (ln2.hook_out; OLMo's hook_resid_mid) to hook_mlp_out, and hook_z (split by heads: its latent is read
    from the whole gathered row) to hook_attn_out — with a plain request beside them, and the second's latents and
    error read by a third: as in one process."""
    _, one, two = pair
    shapes = one.hook_names()
    g = torch.Generator().manual_seed(3)
    d, z = shapes["blocks.1.hook_resid_post"][0], "blocks.1.attn.hook_z"

    def transcoder(hook: str, hook_out: str, d_in: int) -> SAE:
        return SAE(W_enc=torch.randn(d_in, 32, generator=g) * 0.3, b_enc=torch.randn(32, generator=g) * 0.1,
                   W_dec=torch.randn(32, d, generator=g), b_dec=torch.zeros(d), hook=hook, hook_out=hook_out,
                   apply_b_dec_to_input=False)  # fmt: skip

    mlp = transcoder(f"blocks.0.{mlp_input(one.config, 0)}", "blocks.0.hook_mlp_out", d)
    attn = transcoder(z, "blocks.1.hook_attn_out", math.prod(shapes[z]))
    hooks = ["blocks.0.hook_mlp_out", "blocks.1.hook_attn_out", "blocks.2.hook_resid_post"]
    common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "capture": Capture(hooks=hooks)}
    clamps = [Clamp(mlp.writes, mlp, 3, 4.0), Clamp(attn.writes, attn, 5, -2.0, positions=[1, 2, 6])]
    errors = {**common, "capture": Capture(sae=attn, top_k=3, sae_error=True)}
    params = [SamplingParams(**common, interventions=clamps), SamplingParams(**common), SamplingParams(**errors)]
    prompts = sequences((9, 6, 7))
    a, b = _generate(one, prompts, params), _generate(two, prompts, params)
    _check_outputs(a, b)
    (ids_a, values_a), (ids_b, values_b) = a[2].sae_features[z], b[2].sae_features[z]
    assert torch.equal(ids_a, ids_b) and same(values_b.double(), values_a.double(), TOL)
    assert len(a[2].sae_errors[z]) == 10 and same(b[2].sae_errors[z].double(), a[2].sae_errors[z].double(), TOL)
    plain = _generate(one, prompts[:1], params[1:2])
    for hook in hooks:
        assert not same(plain[0].activations[hook].double(), a[0].activations[hook].double(), 1e-3)  # they took


def test_optional_hooks_named_in_requests_read_and_steered(pair):
    """TransformerLens's optional hooks in engine requests: read (heads chosen from both ranks) and steered at one
    head's output and one key-value head's input, with a plain request beside them: as in one process."""
    _, one, two = pair
    cfg, g = one.config, torch.Generator().manual_seed(5)
    hooks = ["blocks.0.attn.hook_result", "blocks.1.hook_q_input", "blocks.2.hook_mlp_in", "blocks.2.hook_resid_post"]
    steers = [Steer("blocks.0.attn.hook_result", torch.randn(cfg.hidden_size, generator=g), heads=[cfg.num_heads - 1]),
              Steer("blocks.1.hook_v_input", torch.randn(cfg.hidden_size, generator=g), heads=[0], scale=2.0)]  # fmt: skip
    common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    params = [SamplingParams(**common, capture=Capture(hooks=hooks, heads=[cfg.num_heads - 1, 0]), interventions=steers),
              SamplingParams(**common, capture=Capture(hooks=[*hooks, "blocks.1.hook_k_input"]))]  # fmt: skip
    prompts = sequences((9, 6))
    a, b = _generate(one, prompts, params), _generate(two, prompts, params)
    _check_outputs(a, b)
    plain = _generate(one, prompts[:1], params[1:])
    assert not same(plain[0].activations[hooks[-1]].double(), a[0].activations[hooks[-1]].double(), 1e-3)  # they took


def test_heads_chosen_from_both_ranks(pair):
    """Capture(heads=...) keeps the named heads, in that order, from whichever rank holds each."""
    _, one, two = pair
    heads = [one.config.num_heads - 1, 0]
    capture = Capture(hooks=["blocks.*.attn.hook_z", "blocks.0.attn.hook_pattern"], heads=heads)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=capture)
    _check_outputs(_generate(one, sequences((6,)), params), _generate(two, sequences((6,)), params))


def test_logit_lens_and_logits_cover_the_vocabulary(pair):
    """The logit lens, plain and tuned (a random tuned lens), and the logits: as in one process."""
    _, one, two = pair
    cfg, g = one.config, torch.Generator().manual_seed(6)
    lens = TunedLens(torch.randn(cfg.num_layers, cfg.hidden_size, cfg.hidden_size, generator=g) * 0.1,
                     torch.randn(cfg.num_layers, cfg.hidden_size, generator=g) * 0.1)  # fmt: skip
    common = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    params = [SamplingParams(**common, capture=Capture(hooks=["blocks.1.hook_resid_post"], logit_lens=5)),
              SamplingParams(**common, capture=Capture(hooks=["blocks.0.hook_resid_post"], logit_lens=5,
                                                       tuned_lens=lens))]  # fmt: skip
    prompts = sequences((8, 4))
    a, b = _generate(one, prompts, params), _generate(two, prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for key in x.logit_lens:
            ids_a, values_a = x.logit_lens[key]
            ids_b, values_b = y.logit_lens[key]
            assert torch.equal(ids_a, ids_b) and same(values_b.double(), values_a.double(), TOL)



@pytest.mark.parametrize("pair", ["qwen3_5", "qwen3_next"], indirect=True)
def test_linear_attention_steered_by_value_heads(pair):
    """A steer of some value heads of a linear-attention layer (one on each rank) and an ablation of its keys: the
    edited layer's rows and the tokens after, as in one process."""
    _, one, two = pair
    hook = "blocks.3.linear_attn.hook_v"
    g = torch.Generator().manual_seed(0)
    edits = [Steer(hook, torch.randn(2, 8, generator=g), heads=[0, 3]),
             Ablate("blocks.3.linear_attn.hook_k", torch.randn(16, generator=g))]  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, interventions=edits,
                            capture=Capture(hooks=["blocks.3.linear_attn.hook_*", "blocks.3.hook_resid_post"]))
    prompts = sequences((20, 9, 3))
    _check_outputs(_generate(one, prompts, params), _generate(two, prompts, params))
