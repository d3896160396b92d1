"""No cross-talk, with every scheduling feature at once: a seeded stream of requests of mixed kinds (greedy, captures
at generated / all / last positions, an attention pattern, steered, ablated, log-probabilities of samples (of
allowed tokens) and of prompts, penalised, prefill-only, seeded samples of one or two sequences, ranked samples
(best_of), stop tokens (not before min_tokens) and strings (kept in the text or not), per-head steering and
patterns, patched rows, logit lens, a mean probe, hidden states, rows left out by token, a transcoder latent clamped
(its latents and error read), TransformerLens's optional hooks read and steered, seeded samples under a regular
expression (structured outputs), a word it says alone banned (bad_words), streamed, aborted; a third of them
under one of two LoRA adapters; in one session each of a priority) arrives at random steps into an engine whose KV
cache is small enough to preempt (in that session the last by priority, which may be one scheduled earlier in its
step), whose prompts share long prefixes (prefix-cache hits mid-run, prefixes borrowed within a step), whose prefill
is chunked, with async scheduling on the static decode path and graphs (emulated: tests/replayed_graphs.py). Every
request that ends must end as it does served alone on a plain engine over the same checkpoint (no prefix cache, no
chunking, synchronous, no static path, no streaming; an adapter's request, on such an engine of the adapter's
directory: its weights merged): the same tokens, text and finish, log-probability ranks equal and values within
1e-5, captured rows at the same positions within 1e-5; streamed deltas add up to the output. Each session preempts,
hits the prefix cache, borrows, chunks, queues steps ahead and replays graphs (the test checks), so a row that lands
in another request, a recompute that captures twice, KV reused across interventions, or a queued step that reads a
stale input shows up as a difference from the request alone. The same sessions run on a Qwen 3.5 (a linear-attention
layer after two attention layers), whose states per sequence live in state slots and which caches and borrows no
prefix: a state read from another sequence's slot, or advanced twice, shows up the same way."""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from family_parity import COMMON, build
from replayed_graphs import replay_graphs
from test_parity_qwen3_5 import text_config as qwen3_5_config
from transformers import LlamaConfig

from vlens import (
    LLM,
    SAE,
    Ablate,
    Capture,
    Clamp,
    Logprob,
    LoRARequest,
    Patch,
    RequestOutput,
    SamplingParams,
    Steer,
    StructuredOutputsParams,
)  # fmt: skip
from vlens.engine.llm_engine import NewRequest
from vlens.engine.model_runner import ModelRunner
from vlens.engine.penalties import spell_bad_words
from vlens.engine.sequence import Sequence

D, VOCAB = COMMON["hidden_size"], COMMON["vocab_size"]
D_HEAD = D // COMMON["num_attention_heads"]
NUM_BLOCKS = 24  # 96 tokens of KV for up to 6 sequences of up to ~50 tokens: preemption
ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
_g = torch.Generator().manual_seed(0)
TRANSCODER = SAE(W_enc=torch.randn(D, 16, generator=_g), b_enc=torch.randn(16, generator=_g), W_dec=torch.randn(16, D, generator=_g),
                 b_dec=torch.zeros(D), hook="blocks.0.ln2.hook_out", hook_out="blocks.0.hook_mlp_out",
                 apply_b_dec_to_input=False)  # fmt: skip


# a tiny GQA Llama; and Qwen 3.5's layers, two of gated attention, then a gated delta net (states per sequence in
# state slots, no prefix cache)
MODELS = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "qwen3_5": lambda: qwen3_5_config(layer_types=["full_attention", "full_attention", "linear_attention"]),
}


@pytest.fixture(scope="module")
def path(request, tmp_path_factory, smol_path) -> str:
    """A tiny model with SmolLM2's tokenizer (for streamed requests, whose text grows step by step)."""
    out = build(MODELS[request.param](), tmp_path_factory.mktemp("fuzz"), request.param)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_path / name, Path(out) / name)
    return out


@pytest.fixture(scope="module")
def alone(path) -> LLM:
    """The reference: every request served alone, on the plainest engine."""
    return LLM(model=path, dtype="float32", device="cpu", enable_prefix_caching=False, async_scheduling=False)


@pytest.fixture(scope="module")
def adapters(path) -> dict[LoRARequest, LLM]:
    """Two PEFT adapters of the model (its q and v and its MLPs; not o_proj, whose head results a request reads), each
    with its reference: the plainest engine of the adapter's directory, the adapter merged into its weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made = {}
    for i in range(2):
        torch.manual_seed(i)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
        directory = Path(path).parent / f"adapter{i}"
        get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)) \
            .save_pretrained(directory)  # fmt: skip
        made[LoRARequest(f"adapter{i}", i + 1, str(directory))] = LLM(
            model=str(directory), dtype="float32", device="cpu", enable_prefix_caching=False, async_scheduling=False)
    return made


@dataclass
class Arrival:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    kind: str
    lora: LoRARequest | None = None


UNDER = 1  # (the adapters' draws: seeded apart, UNDER after the session's seed)
KINDS = ("greedy", "generated", "all", "stop", "pattern", "steer", "ablate", "logprobs", "prompt logprobs", "penalised",
         "prefill only", "seeded", "seeded n=2", "stop string", "best of", "heads", "patch", "logit lens", "probe",
         "hidden", "exclude", "transcoder", "optional", "structured", "bad words")  # fmt: skip


def _params(kind: str, max_tokens: int, prompt: list[int], g: torch.Generator, alone: LLM) -> SamplingParams:
    """A request of `kind`, with its own vectors and seeds drawn from `g`."""
    greedy = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if kind in ("stop", "stop string"):  # on a token it generates alone, or on text it does
        run = alone.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
        at = int(torch.randint(0, max_tokens, (), generator=g))
        stop = (dict(stop_token_ids=[run.token_ids[at]], min_tokens=at // 2) if kind == "stop"  # (not before)
                else dict(stop=[run.text[at : at + 2] or "."], include_stop_str_in_output=at % 2 == 0))
        return SamplingParams(max_tokens=max_tokens, temperature=0, **stop,
                              capture=Capture("blocks.2.hook_resid_pre", positions="last"))  # fmt: skip
    if kind == "bad words":  # a word it says alone, banned: other tokens from there on
        run = alone.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
        at = int(torch.randint(0, max_tokens, (), generator=g))
        said = [alone.tokenizer.decode(run.token_ids[i : i + 2]) for i in [*range(at, max_tokens), *range(at)]]
        words = [w for w in said if w.strip() and max(map(max, spell_bad_words([w], alone.tokenizer))) < VOCAB]
        return SamplingParams(**greedy, bad_words=words[:1] or None)  # (the tiny model's vocabulary: 300 tokens)
    n = len(prompt)
    fields = {
        "greedy": lambda: greedy,
        "generated": lambda: greedy | dict(capture=Capture(
            ["blocks.0.hook_resid_post", "blocks.2.mlp.hook_post", "blocks.1.attn.hook_z"], positions="generated")),
        "all": lambda: greedy | dict(capture=Capture(["blocks.1.hook_resid_post", "unembed.hook_out"])),
        "pattern": lambda: greedy | dict(capture=Capture("blocks.1.attn.hook_pattern")),
        "steer": lambda: greedy | dict(
            interventions=[Steer("blocks.1.hook_resid_post", torch.randn(D, generator=g), scale=3.0)],
            capture=Capture("blocks.2.hook_resid_post", positions="generated")),
        "ablate": lambda: greedy | dict(
            interventions=[Ablate("blocks.1.hook_attn_out", torch.randn(D, generator=g))], logprobs=2),
        "logprobs": lambda: dict(max_tokens=max_tokens, temperature=0, logprobs=3, allowed_token_ids=prompt),
        "prompt logprobs": lambda: greedy | dict(prompt_logprobs=2, logprobs=1),  # computes its whole prompt
        "penalised": lambda: greedy | dict(frequency_penalty=0.5),  # no step of it is queued ahead
        "prefill only": lambda: dict(max_tokens=0, capture=Capture("blocks.0.hook_resid_post")),  # one layer run
        "seeded": lambda: dict(max_tokens=max_tokens, temperature=0.9, top_k=40, logprobs=2,
                               seed=int(torch.randint(0, 2**31, (), generator=g))),
        "seeded n=2": lambda: dict(max_tokens=max_tokens, temperature=1.0, top_p=0.9, n=2,
                                   seed=int(torch.randint(0, 2**31, (), generator=g))),
        "best of": lambda: dict(max_tokens=max_tokens, temperature=1.0, n=2, best_of=3, logprobs=1,
                                seed=int(torch.randint(0, 2**31, (), generator=g))),
        "heads": lambda: greedy | dict(
            interventions=[Steer("blocks.0.attn.hook_z", torch.randn(D_HEAD, generator=g), scale=2.0, heads=[1])],
            capture=Capture("blocks.1.attn.hook_pattern", heads=[3, 0], positions=[0, n - 1, -1])),
        "patch": lambda: greedy | dict(
            interventions=[Patch("blocks.1.hook_resid_pre", torch.randn(2, D, generator=g), positions=slice(n - 2, n))],
            capture=Capture("blocks.2.hook_resid_post", positions=slice(n - 3, None))),
        "logit lens": lambda: greedy | dict(capture=Capture("blocks.1.hook_resid_mid", logit_lens=3, positions="::2")),
        "probe": lambda: greedy | dict(capture=Capture(
            "blocks.1.hook_resid_post", project=(torch.randn(D, 5, generator=g), torch.randn(5, generator=g)),
            reduce="mean", positions="prompt")),
        "hidden": lambda: dict(max_tokens=max_tokens, temperature=0.7, return_hidden_states=True,
                               seed=int(torch.randint(0, 2**31, (), generator=g))),
        "exclude": lambda: greedy | dict(capture=Capture("blocks.0.hook_mlp_out", exclude_token_ids=prompt[:2])),
        "transcoder": lambda: greedy | dict(  # (its latent read at ln2's output, set at the MLP's; its error there)
            interventions=[Clamp(TRANSCODER.writes, TRANSCODER, int(torch.randint(0, 16, (), generator=g)), 3.0)],
            capture=Capture(sae=TRANSCODER, top_k=3, sae_error=True, positions="generated")),
        "structured": lambda: dict(  # (a grammar's bitmask, filled on the host each step: no step queued ahead)
            max_tokens=max_tokens, temperature=1.0, seed=int(torch.randint(0, 2**31, (), generator=g)),
            structured_outputs=StructuredOutputsParams(regex=r"[a-z]+( [a-z0-9]+){0,40}"), logprobs=1,
            capture=Capture("blocks.1.hook_resid_post", positions="generated")),
        "optional": lambda: greedy | dict(  # (TransformerLens's optional hooks, named in full)
            interventions=[Steer("blocks.0.attn.hook_result", torch.randn(D, generator=g), heads=[1])],
            capture=Capture(["blocks.1.attn.hook_result", "blocks.1.hook_k_input"], heads=[0], positions="generated")),
    }  # fmt: skip
    return SamplingParams(**fields[kind]())


def _script(
    seed: int, alone: LLM, loras: list[LoRARequest], num_requests: int = 30
) -> list[tuple[list[Arrival], int | None]]:  # fmt: skip
    """A seeded serving session: per step, the requests that arrive and which earlier request, counted in
    arrival order, is aborted (or None; one of the last six, which may still run). Most prompts are one of
    three long prefixes and a short tail; now and then three requests behind one prefix arrive together
    (the choices of an lm-eval question), which may borrow it from each other. A third of them run under one of
    `loras` (drawn apart, so that the sessions are those of the base model's requests alone)."""
    g, under = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + UNDER)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=g))

    def tokens(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    def adapter() -> LoRARequest | None:
        pick = int(torch.randint(0, 3 * len(loras), (), generator=under))  # (a third under an adapter)
        return loras[pick] if pick < len(loras) else None

    def arrival(prompt: list[int], kind: str, lora: LoRARequest | None) -> Arrival:
        params = _params(kind, randint(1, 21), prompt, g, alone)
        streamed = bool(torch.rand((), generator=g) < 0.3) and not params.ranks_samples  # (as the server has it)
        if kind.startswith("stop"):  # (its stop is one the base model reaches)
            lora = None
        return Arrival(prompt, params, streamed, kind, lora)

    prefixes = [tokens(randint(12, 24)) for _ in range(3)]
    script, arrived = [], 0
    while arrived < num_requests:
        if torch.rand((), generator=g) < 0.15:
            prefix = prefixes[randint(0, 3)]
            lora = adapter()  # (the choices of one question, under one adapter or none: they may borrow)
            new = [arrival(prefix + tokens(randint(1, 6)), KINDS[randint(0, len(KINDS))], lora) for _ in range(3)]
        else:
            prompts = [prefixes[randint(0, 3)] + tokens(randint(0, 8)) if torch.rand((), generator=g) < 0.75
                       else tokens(randint(2, 16)) for _ in range(randint(0, 3))]  # fmt: skip
            new = [arrival(prompt, KINDS[randint(0, len(KINDS))], adapter()) for prompt in prompts]
        new = new[: num_requests - arrived]
        arrived += len(new)
        abort = randint(max(0, arrived - 6), arrived) if arrived and torch.rand((), generator=g) < 0.15 else None
        script.append((new, abort))
    return script


def _same_logprobs(
    got: list[dict[int, Logprob] | None], want: list[dict[int, Logprob] | None], what: str, tol: float = 1e-5
) -> None:
    """Per token: the same ranks of the same tokens, values within `tol` (relative, past 1: a state restored from a
    kept prefix sums its chunks otherwise than a run from the start, ~4e-6 of a logprob of -3.6 apart). Past 1e-5
    (an adapter's reference, merged) a rank may be one off: two tokens that close may swap."""
    slack = 0 if tol <= 1e-5 else 1
    for px, py in zip(got, want, strict=True):
        assert (px is None) == (py is None), what
        assert (px or {}).keys() == (py or {}).keys(), what
        assert all(abs(px[t].rank - py[t].rank) <= slack for t in px or {}), what
        assert all(abs(px[t].logprob - py[t].logprob) <= tol * max(1.0, abs(py[t].logprob)) for t in px or {}), what


def _same(got: RequestOutput, want: RequestOutput, what: str, tol: float = 1e-5) -> None:
    """A request's output batched against alone: tokens, texts, ends, log-probabilities, captured rows (within
    `tol`)."""
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], what
    assert [c.text for c in got.outputs] == [c.text for c in want.outputs], what
    assert [(c.finish_reason, c.stop_reason) for c in got.outputs] == [(c.finish_reason, c.stop_reason)
                                                                      for c in want.outputs], what  # fmt: skip
    for cx, cy in zip(got.outputs, want.outputs, strict=True):
        assert (cx.logprobs is None) == (cy.logprobs is None), what
        _same_logprobs(cx.logprobs or [], cy.logprobs or [], what, tol)
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None), what
    _same_logprobs(got.prompt_logprobs or [], want.prompt_logprobs or [], what, tol)
    assert got.activations.keys() == want.activations.keys(), what
    for name, rows in want.activations.items():
        assert got.activations[name].shape == rows.shape, (what, name)
        assert rel_err(got.activations[name], rows) < tol, (what, name)
    assert got.logit_lens.keys() == want.logit_lens.keys(), what
    for name, (ids, logprobs) in want.logit_lens.items():
        assert torch.equal(got.logit_lens[name][0], ids) and rel_err(got.logit_lens[name][1], logprobs) < tol, what
    assert got.sae_features.keys() == want.sae_features.keys() and got.sae_errors.keys() == want.sae_errors.keys()
    for name, (ids, values) in want.sae_features.items():
        assert torch.equal(got.sae_features[name][0], ids) and rel_err(got.sae_features[name][1], values) < tol, what
        # (‖x − x̂‖² / ‖x‖²: squared norms double a row's relative noise, 1.7e-5 seen with a random transcoder)
        assert rel_err(got.sae_errors[name], want.sae_errors[name]) < 2 * tol, what
    assert (got.hidden_states is None) == (want.hidden_states is None), what
    if want.hidden_states is not None:
        assert rel_err(got.hidden_states, want.hidden_states) < tol, what
    if want.activation_positions is None:
        assert got.activation_positions is None, what
    else:
        assert torch.equal(got.activation_positions, want.activation_positions), what


def _count(llm: LLM) -> Counter:
    """What the engine's scheduling does that its stats do not count, as it does it: "reused", prompt tokens
    that fresh requests took from the prefix cache as they were admitted (a preempted sequence taking back
    its own blocks is not counted); "borrowed by captures", prompts that capture rows and borrowed a prefix
    computed in their step;
    "chunks", prompt chunks that left part of their prompt to a later step."""
    engine, seen, counts = llm.engine, set(), Counter()
    admit, schedule = engine.blocks.admit, engine.scheduler.schedule

    def admitting(seq: Sequence) -> None:
        admit(seq)
        if seq not in seen:
            seen.add(seq)
            counts["reused"] += seq.num_computed

    def scheduling() -> list[tuple[Sequence, int]]:
        scheduled = schedule()
        counts["borrowed by captures"] += sum(seq.borrow is not None and bool(seq.taps.streams) for seq, _ in scheduled)
        counts["chunks"] += sum(seq.num_computed + n < seq.num_prompt for seq, n in scheduled)
        return scheduled

    engine.blocks.admit, engine.scheduler.schedule = admitting, scheduling
    return counts


@pytest.mark.parametrize("path", list(MODELS), indirect=True)
@pytest.mark.parametrize("seed", [12, 17, 19, 8])  # sessions that do all of it (the last asserts check)
def test_a_mixed_continuous_batch_matches_each_request_alone(path, alone, adapters, seed):
    stateful = bool(alone.runner.stateful)
    kv_bytes = NUM_BLOCKS * ModelRunner.bytes_per_block(alone.model, ENGINE["block_size"])
    kv_bytes += (ENGINE["max_num_seqs"] + 1) * ModelRunner.bytes_per_state(alone.model)  # (their slots, first)
    ranked = seed == 8  # (this session schedules by priority, each request's drawn from -2 to 2: preempting a
    # sequence scheduled earlier in its step, which first come, first served never does)
    llm = LLM(model=path, kv_cache_memory=kv_bytes, enable_lora=True, max_loras=2, max_lora_rank=4,
              scheduling_policy="priority" if ranked else "fcfs", **ENGINE)  # fmt: skip
    replay_graphs(llm.runner)
    ranks = torch.Generator().manual_seed(seed)  # (apart from the script's draws)
    engine, counts = llm.engine, _count(llm)
    ids, arrivals, aborted, done, streamed = [], [], set(), {}, {}

    def step() -> None:
        for delta in engine.step():
            assert delta.request_id not in aborted, "a delta after its request was aborted"
            tokens, text = streamed.setdefault((delta.request_id, delta.index), ([], []))
            tokens += delta.token_ids
            text.append(delta.text)
            if delta.output is not None:
                done[delta.request_id] = delta.output

    for new, abort in _script(seed, alone, list(adapters)):
        priorities = torch.randint(-2, 3, (len(new),), generator=ranks).tolist() if ranked else [0] * len(new)
        ids += engine.add_requests([NewRequest(a.prompt, a.params, stream=a.stream, lora=a.lora, priority=p)
                                    for a, p in zip(new, priorities)])  # fmt: skip
        arrivals += new
        if abort is not None and ids[abort] not in done:
            engine.abort(ids[abort])
            aborted.add(ids[abort])
        step()
    while engine.has_work():
        step()

    stats = engine.stats()
    assert stats.kv_blocks_used == 0  # every block came back
    assert len(done) + len(aborted) == len(ids) and aborted
    ranked = {request for request, arrival in zip(ids, arrivals) if arrival.params.ranks_samples}
    for (request, index), (tokens, text) in streamed.items():
        if request in done and request not in ranked:  # (a ranked request's outputs are not in sample order)
            assert tokens == done[request].outputs[index].token_ids
            assert "".join(text) == done[request].outputs[index].text
    for request, arrival in zip(ids, arrivals, strict=True):
        if request in done:
            reference = alone if arrival.lora is None else adapters[arrival.lora]
            want = reference.generate([arrival.prompt], arrival.params, use_tqdm=False)[0]
            under = "" if arrival.lora is None else f", under {arrival.lora.lora_name}"
            # (an adapter's reference has it merged: W + sBA rounds otherwise than xW + s(xA)B, up to ~1e-5 apart a
            # few layers on; tests/test_lora.py holds the adapter's own path to PEFT's forward within 1e-5)
            tol = 1e-5 if arrival.lora is None else 2e-5
            _same(done[request], want, f"request {request} ({arrival.kind}, prompt of {len(arrival.prompt)}{under})",
                  tol)  # fmt: skip
    graphs = llm.runner.graph_stats
    assert stats.num_preemptions > 0 and graphs.ahead_steps > 0 and graphs.graph_steps > 0
    # (a model with states per sequence borrows no prefix in its step: it starts from prefixes' kept states)
    assert counts["reused"] > 0 and (counts["borrowed by captures"] > 0) != stateful and counts["chunks"] > 0
    assert any(c.finish_reason == "stop" for out in done.values() for c in out.outputs)
    under = Counter(a.lora.lora_name for request, a in zip(ids, arrivals) if request in done and a.lora is not None)
    assert len(under) == 2  # (both adapters ran)
