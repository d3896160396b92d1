"""LoRA adapters beside the base model (vlens.engine.lora), against PEFT's own models of the same adapters: requests
under two adapters (attention's projections; the MLP's and k, rsLoRA) and none in one batch give PEFT's greedy tokens
and rows; a request without one gives the plain engine's; the prefix cache keeps each adapter's blocks
apart; slots are reused in turns; Phi-3's fused projection; what vlens cannot run is refused by name before any
request runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from family_parity import COMMON, build, hf_auto_class, same, sequences
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, LlamaConfig, Phi3Config

from vlens import LLM, Capture, LoRARequest, SamplingParams
from vlens.engine.llm_engine import NewRequest

ADAPTERS = {  # name -> (target modules, rank, alpha, rsLoRA)
    "attention": (["q_proj", "v_proj", "o_proj"], 4, 8, False),
    "mlp": (["gate_proj", "up_proj", "down_proj", "k_proj"], 8, 16, True),
}
HOOK = "blocks.1.hook_resid_post"


def _base(path: str) -> torch.nn.Module:
    return hf_auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32).eval()


def _adapter(path: str, root: Path, name: str, targets, rank: int, alpha: int, rslora: bool, seed: int):
    """A PEFT model of random LoRA weights on the checkpoint at `path`, and the LoRARequest of its saved adapter."""
    torch.manual_seed(seed)
    model = get_peft_model(_base(path), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                   use_rslora=rslora, init_lora_weights=False))  # fmt: skip
    model.save_pretrained(root / name)
    return model.eval(), LoRARequest(name, seed + 1, str(root / name))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    path = build(LlamaConfig(**COMMON), root, "llama")
    adapters = {name: _adapter(path, root, name, *spec, seed=i) for i, (name, spec) in enumerate(ADAPTERS.items())}
    return path, _base(path), adapters


def _greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF's (or PEFT's) greedy tokens, and layer 1's output at every row of prompt + tokens but the last."""
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0]  # fmt: skip
        hidden = model(seq[None, :-1], output_hidden_states=True).hidden_states[2][0]
    return seq[len(prompt) :].tolist(), hidden


def _params(steps: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, capture=Capture(HOOK, positions="all"))


def test_adapters_and_none_in_one_batch(llama):
    path, base, adapters = llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True, max_loras=2)
    plain = LLM(path, dtype="float32", device="cpu", block_size=4)
    prompts = sequences((20, 9, 3, 14, 7))
    names = [None, "attention", "mlp", "attention", None]
    loras = [None if n is None else adapters[n][1] for n in names]
    outs = llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)
    for prompt, out, name in zip(prompts, outs, names):
        tokens, hidden = _greedy(base if name is None else adapters[name][0], prompt, 8)
        assert out.outputs[0].token_ids == tokens, name
        assert (out.activations[HOOK] - hidden).norm() <= 1e-5 * hidden.norm(), name
    alone = plain.generate([prompts[0], prompts[4]], _params(), use_tqdm=False)
    for got, want in zip([outs[0], outs[4]], alone):  # (a request without an adapter: the plain engine's; its steps
        # ran eagerly here, beside the adapters' requests, and on the static decode path there)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert same(got.activations[HOOK], want.activations[HOOK], 1e-6)
    assert outs[1].outputs[0].token_ids != outs[0].outputs[0].token_ids or prompts[1] == prompts[0]
    assert llm.stats().static_eager_steps >= 7  # (the decode steps, adapters' rows and all, on the static path)


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(llama):
    path, base, adapters = llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True)
    prompt, params = sequences((23,))[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    runs = [None, adapters["mlp"][1], adapters["mlp"][1], None]
    outs = [llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0] for lora in runs]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 20, 20]  # (the adapter's blocks, then the base's again)
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids == _greedy(adapters["mlp"][0], prompt, 4)[0]
    assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids == _greedy(base, prompt, 4)[0]


def test_adapters_in_turns_and_refusals_before_anything_runs(llama, tmp_path):
    path, base, adapters = llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True, max_loras=1, max_lora_rank=4)
    prompt = sequences((9,))[0]
    attention = adapters["attention"][1]
    with pytest.raises(ValueError, match="max_lora_rank=4; raise max_lora_rank"):
        llm.generate([prompt], _params(2), use_tqdm=False, lora_request=adapters["mlp"][1])
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True, max_loras=1)
    names = ["attention", "mlp", "attention", None, "mlp"]  # (one slot: each adapter's requests in turn, as it frees)
    outs = llm.generate([prompt] * 5, _params(6), use_tqdm=False,
                        lora_request=[None if n is None else adapters[n][1] for n in names])  # fmt: skip
    for out, name in zip(outs, names):
        assert out.outputs[0].token_ids == _greedy(base if name is None else adapters[name][0], prompt, 6)[0], name
    assert llm.engine.loras.holders == [0]
    engine = llm.engine  # (the same, step by step: the stats name the adapters of running and of waiting requests)
    engine.add_requests([NewRequest(prompt, _params(6), lora=None if n is None else adapters[n][1]) for n in names])
    engine.step()
    stats = engine.stats()
    assert (stats.max_loras, stats.running_loras, stats.waiting_loras) == (1, ("attention",), ("attention", "mlp"))
    while engine.has_work():
        engine.step()
    for name in ("attention", "mlp", "attention"):  # (one slot, its adapter replaced between calls)
        out = llm.generate([prompt], _params(6), use_tqdm=False, lora_request=adapters[name][1])[0]
        assert out.outputs[0].token_ids == _greedy(adapters[name][0], prompt, 6)[0], name
    impostor = LoRARequest("other", attention.lora_int_id, adapters["mlp"][1].lora_path)
    refusals = [
        (LLM(path, dtype="float32", device="cpu"), attention, "this engine runs no LoRA adapters; create it with "
                                                              "LLM\\(..., enable_lora=True\\)"),
        (llm, LoRARequest("missing", 9, str(tmp_path)), "holds no adapter_config.json and adapter_model.safetensors"),
        (llm, impostor, "lora_int_id 1 is already 'attention'"),
        (llm, LoRARequest("zero", 0, attention.lora_path), "lora_int_id 0 is not a positive integer"),
    ]
    for engine, request, message in refusals:
        with pytest.raises(ValueError, match=message):
            engine.generate([prompt], _params(2), use_tqdm=False, lora_request=request)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((Path(attention.lora_path) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    weights = (Path(attention.lora_path) / "adapter_model.safetensors").read_bytes()
    (dora / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        llm.generate([prompt], _params(2), use_tqdm=False, lora_request=LoRARequest("dora", 7, str(dora)))


def test_an_adapter_of_the_unembedding_is_refused_by_name(llama, tmp_path):
    path, _, _ = llama
    _, request = _adapter(path, tmp_path, "head", ["lm_head", "q_proj"], 4, 8, False, seed=5)
    llm = LLM(path, dtype="float32", device="cpu", enable_lora=True)
    with pytest.raises(ValueError, match=r"holds \['base_model.model.lm_head.base_layer.weight'\], which are no LoRA"):
        llm.generate([[1, 2, 3]], _params(2), use_tqdm=False, lora_request=request)


def test_a_fused_projection(tmp_path):
    """Phi-3 stores q, k and v as one qkv_proj (and gate and up as one): PEFT adapts the fused module."""
    path = build(Phi3Config(**(COMMON | dict(pad_token_id=0))), tmp_path, "phi3")
    model, request = _adapter(path, tmp_path, "fused", ["qkv_proj", "gate_up_proj", "o_proj"], 4, 8, False, seed=3)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True)
    prompts = sequences((20, 9))
    outs = llm.generate(prompts, _params(), use_tqdm=False, lora_request=[request, None])
    for prompt, out, ref in zip(prompts, outs, (model, _base(path))):
        tokens, hidden = _greedy(ref, prompt, 8)
        assert out.outputs[0].token_ids == tokens
        assert (out.activations[HOOK] - hidden).norm() <= 1e-5 * hidden.norm()


def test_served_under_their_names(smol4_path, tmp_path):
    """vlens serve --lora-modules NAME=PATH: each adapter a model of its own in /v1/models (vLLM's card: its parent,
    its root), a request's model picks it (completions, chat), an unknown name is a 404 listing them."""
    import httpx
    from server_helpers import running_server

    from vlens.server.app import create_app
    from vlens.server.config import ServerConfig

    _, request = _adapter(str(smol4_path), tmp_path, "terse", ["q_proj", "v_proj", "down_proj"], 8, 32, False, seed=7)
    llm = LLM(str(smol4_path), dtype="float32", device="cpu", enable_lora=True)
    prompt, params = "The capital of France is", SamplingParams(max_tokens=8, temperature=0)
    want = {name: llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for name, lora in (("base", None), ("terse", request))}  # fmt: skip
    assert want["base"] != want["terse"]
    chat = [{"role": "user", "content": "Say hi"}]
    replied = llm.chat(chat, params, use_tqdm=False, lora_request=request)[0].outputs[0].text
    config = ServerConfig(lora_modules=(f"terse={request.lora_path}",), served_model_name="base")
    with running_server(llm, config) as url:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m.get("parent"), m.get("root")) for m in models] == [
            ("base", None, None), ("terse", "base", request.lora_path)]  # fmt: skip
        for model in ("base", "terse"):
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
            assert answer["choices"][0]["text"] == want[model] and answer["model"] == model
        asked = {"model": "terse", "messages": chat, "max_tokens": 8, "temperature": 0}
        answer = httpx.post(url + "/v1/chat/completions", json=asked, timeout=120).json()
        assert answer["choices"][0]["message"]["content"] == replied
        metrics = httpx.get(url + "/metrics").text
        assert 'vlens_lora_requests_info{running_lora_adapters="",waiting_lora_adapters="",max_lora="1"} 1' in metrics
        missing = httpx.post(url + "/v1/completions", json={**body, "model": "verbose"}, timeout=120)
        assert missing.status_code == 404 and missing.json()["error"]["message"].endswith(
            "and under its LoRA adapters: 'terse'")
    with pytest.raises(ValueError, match="lora_modules: the model was built without enable_lora=True"):
        create_app(LLM(str(smol4_path), dtype="float32", device="cpu"), ServerConfig(lora_modules=(f"t={tmp_path}",)))
    with pytest.raises(ValueError, match="lora_modules: 'base' is the served model's or a steering vector's name"):
        create_app(llm, ServerConfig(lora_modules=(f"base={request.lora_path}",), served_model_name="base"))


def test_a_trace_under_an_adapter(llama):
    """LLM.trace(lora_request=...): every layer's stream and the logits of PEFT's model, packed beside each other."""
    path, base, adapters = llama
    model, request = adapters["mlp"]
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True)
    hooks = [f"hidden_states.{i}" for i in range(4)] + ["unembed.hook_out"]
    for ids, got in zip(sequences(), llm.trace(sequences(), hooks, lora_request=request)):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        want = [h[0] for h in out.hidden_states] + [out.logits[0]]
        assert all(same(got[hook], w, 1e-5) for hook, w in zip(hooks, want))
    plain = llm.trace(sequences(), "unembed.hook_out")[-1]["unembed.hook_out"]  # (the slot let go: the base model)
    with torch.no_grad():
        assert same(plain, base(torch.tensor([sequences()[-1]])).logits[0], 1e-5)
    assert llm.engine.loras.holders == [0]


def test_head_results_of_an_adapted_output_projection_are_refused(llama):
    """attn.hook_result splits o_proj's product by head, which the adapter's update of o_proj is not part of."""
    path, _, adapters = llama
    llm = LLM(path, dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(max_tokens=2, capture=Capture("blocks.1.attn.hook_result"))
    with pytest.raises(ValueError, match="adapts layer 1's output projection, which blocks.1.attn.hook_result splits"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=adapters["attention"][1])
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=adapters["mlp"][1])[0]  # (its o_proj's own)
    assert out.activations["blocks.1.attn.hook_result"].shape[1:] == (4, 64)


def test_latent_attention_with_and_without_the_latent_cache(tmp_path):
    """DeepSeek-V3: an adapter of every projection of its latent attention, PEFT's tokens; with latent_kv_cache, whose
    heads read kv_b_proj whole, an adapter of kv_b_proj is refused by name, and one of the latents' projections runs
    (the cached latents are the adapted ones)."""
    from test_parity_deepseek import CONFIGS

    path = build(CONFIGS["deepseek_v3"](), tmp_path, "v3")
    every = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    model, request = _adapter(path, tmp_path, "latent", every, 4, 8, False, seed=4)
    prompt = sequences((20,))[0]
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True)
    assert llm.generate([prompt], _params(), use_tqdm=False, lora_request=request)[0].outputs[0].token_ids == \
        _greedy(model, prompt, 8)[0]  # fmt: skip
    latent = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True, latent_kv_cache=True)
    with pytest.raises(ValueError, match=r"adapts model.layers.0.self_attn.kv_b_proj, which the heads read through "
                                         r"the latent KV cache"):  # fmt: skip
        latent.generate([prompt], _params(2), use_tqdm=False, lora_request=request)
    latents = ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"]
    model, request = _adapter(path, tmp_path, "latents", latents, 4, 8, False, seed=6)
    out = latent.generate([prompt], _params(), use_tqdm=False, lora_request=request)[0]
    tokens, hidden = _greedy(model, prompt, 8)
    assert out.outputs[0].token_ids == tokens and same(out.activations[HOOK], hidden, 1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["replayed_graphs", "compile_decode"])
def test_decode_graphs_hold_the_adapters(llama, compiled):
    """Decode steps under adapters replayed from (emulated) CUDA graphs, or through compile_decode's compiled forward,
    each row's slot read from the step's buffer: PEFT's tokens and rows; a graph of its own where adapters run."""
    from replayed_graphs import replay_graphs

    path, base, adapters = llama
    settings = dict(compile_decode=True) if compiled else {}
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True, max_loras=2, **settings)
    if not compiled:
        replay_graphs(llm.runner)
    prompts = sequences((20, 9, 3))
    names = ["attention", None, "mlp"]
    loras = [None if n is None else adapters[n][1] for n in names]
    llm.generate(prompts, _params(), use_tqdm=False)  # (first the base model's graphs of these shapes)
    for _ in range(2):  # (the second time, the adapters' graphs are replayed)
        outs = llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)
        for prompt, out, name in zip(prompts, outs, names):
            tokens, hidden = _greedy(base if name is None else adapters[name][0], prompt, 8)
            assert out.outputs[0].token_ids == tokens, name
            assert (out.activations[HOOK] - hidden).norm() <= 1e-5 * hidden.norm(), name
    stats = llm.runner.graph_stats
    assert (stats.compiled_steps if compiled else stats.graph_steps) >= 12


def test_an_adapters_directory_is_its_base_model_merged(llama, tmp_path):
    """LLM(adapter directory), as HF's from_pretrained of one runs its base model under it: the adapter merged into
    the base's weights (PEFT's merge_and_unload): every layer and the logits of PEFT's model within 1e-5, its greedy
    tokens, on two ranks as in one process; a harvest's manifest records the adapter's hash."""
    from harvest_helpers import write_jsonl
    from test_tensor_parallel import _check_outputs

    from vlens import harvest

    path, base, adapters = llama
    model, request = adapters["attention"]
    llm = LLM(request.lora_path, dtype="float32", device="cpu", block_size=4)
    assert llm.adapter_path == Path(request.lora_path) and llm.model_path == Path(path)
    hooks = [f"hidden_states.{i}" for i in range(4)] + ["unembed.hook_out"]
    for ids, got in zip(sequences(), llm.trace(sequences(), hooks)):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        assert all(same(got[h], w, 1e-5) for h, w in zip(hooks, [*(h[0] for h in out.hidden_states), out.logits[0]]))
    prompts, params = sequences((20, 9)), _params()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_greedy(model, p, 8)[0] for p in prompts]
    two = LLM(request.lora_path, dtype="float32", device="cpu", block_size=4, tensor_parallel_size=2)
    try:
        _check_outputs(outs, two.generate(prompts, params, use_tqdm=False))
    finally:
        two.close()
    documents = [[(7 * i + j) % 300 for j in range(20)] for i in range(4)]
    source = write_jsonl(tmp_path / "tokens.jsonl", documents, "tokens")
    harvest(request.lora_path, source, "blocks.1.hook_resid_post", tmp_path / "acts", context_size=16, progress=False)
    manifest = json.loads((tmp_path / "acts" / "manifest.json").read_text())
    assert manifest["model"]["adapter_sha256"] and manifest["model"]["weights_sha256"]
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(ValueError, match="a LoRA adapter whose adapter_config.json names no base_model_name_or_path"):
        LLM(str(tmp_path / "orphan"), dtype="float32", device="cpu")


def test_an_adapter_beside_the_base_model_as_its_merged_model(llama):
    """Chunked prefill (16 tokens a step), parallel seeded samples, prompt log-probabilities and a capture under an
    adapter, beside base requests, against the merged adapter's own engine: the same tokens, log-probabilities and
    rows (the two sum in other orders: 1e-5)."""
    path, _, adapters = llama
    request = adapters["mlp"][1]
    settings = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
    beside, merged = LLM(path, enable_lora=True, **settings), LLM(request.lora_path, **settings)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    captured = SamplingParams(max_tokens=6, temperature=0, capture=Capture(HOOK), ignore_eos=True)
    prompts, params = sequences((30, 9, 21)), [sampled, sampled, captured]
    got = beside.generate(prompts, params, use_tqdm=False, lora_request=[request, None, request])
    want = merged.generate([prompts[0], prompts[2]], [sampled, captured], use_tqdm=False)
    for a, b in zip([got[0], got[2]], want):
        assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
    for x, y in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
    assert same(got[2].activations[HOOK], want[1].activations[HOOK], 1e-5)


def test_two_ranks_as_one_process(llama):
    """Tensor parallelism (gloo, one thread a rank): each rank its shard of each adapter (its rows of B where the
    projection splits its output, its columns of A where it splits its input: a partial update summed with the
    partial output), in the slots rank 0 put them in: the same tokens and rows as one process."""
    from test_tensor_parallel import _check_outputs

    path, _, adapters = llama
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the workers take rank 0's)
    one = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True, max_loras=2)
    two = LLM(path, dtype="float32", device="cpu", block_size=4, enable_lora=True, max_loras=2, tensor_parallel_size=2)
    try:
        prompts = sequences((20, 9, 3, 14))
        loras = [adapters["attention"][1], None, adapters["mlp"][1], adapters["attention"][1]]
        hooks = ["blocks.0.attn.hook_z", "blocks.1.mlp.hook_post", "blocks.2.hook_resid_post"]
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
        run = [llm.generate(prompts, params, use_tqdm=False, lora_request=loras) for llm in (one, two)]
        _check_outputs(*run)
        assert [o.outputs[0].token_ids for o in run[0]][2] == _greedy(adapters["mlp"][0], prompts[2], 6)[0]
    finally:
        two.close()
        torch.set_num_threads(threads)


def test_serve_gives_every_adapter_a_slot_and_its_rank(tmp_path):
    """`vlens serve --lora-modules a=.. b=..` builds the engine with enable_lora, max_loras 2 and the larger rank (32,
    past the default 16); an LLM built with fewer slots than adapters is refused by name."""
    from vlens.server.app import create_app
    from vlens.server.cli import lora_settings
    from vlens.server.config import ServerConfig

    for name, rank in (("a", 8), ("b", 32)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    specs = (f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}")
    flags = SimpleNamespace(max_loras=1, max_lora_rank=16)
    assert lora_settings(specs, flags) == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 32}
    assert lora_settings(None, flags) == {}
    path = build(LlamaConfig(**COMMON), tmp_path, "llama")
    with pytest.raises(ValueError, match=r"lora_modules: 2 adapters, and the model was built with max_loras=1"):
        create_app(LLM(path, dtype="float32", device="cpu", enable_lora=True), ServerConfig(lora_modules=specs))


def test_adapters_loaded_and_unloaded_while_serving(smol4_path, tmp_path):
    """--allow-runtime-lora-updating: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter. A loaded adapter is a
    model of its own at once (listed, answering as the engine does under it); a bad one is a 400 naming the field; an
    unloaded one is a 404 again; without the flag the routes are 404."""
    import httpx
    from server_helpers import running_server

    from vlens.server.config import ServerConfig

    _, request = _adapter(str(smol4_path), tmp_path, "terse", ["q_proj", "v_proj", "down_proj"], 8, 32, False, seed=7)
    llm = LLM(str(smol4_path), dtype="float32", device="cpu", enable_lora=True)
    prompt, params = "The capital of France is", SamplingParams(max_tokens=8, temperature=0)
    want = llm.generate(prompt, params, use_tqdm=False, lora_request=request)[0].outputs[0].text
    body = {"model": "terse", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    load = {"lora_name": "terse", "lora_path": request.lora_path}
    with running_server(llm, ServerConfig(allow_runtime_lora_updating=True, served_model_name="base")) as url:
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 404
        loaded = httpx.post(url + "/v1/load_lora_adapter", json=load)
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'terse' added successfully."
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["base", "terse"]
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == want
        again = httpx.post(url + "/v1/load_lora_adapter", json=load)
        assert again.status_code == 400 and "is served already" in again.json()["error"]["message"]
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "terse"})
        assert gone.status_code == 200
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 404
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "terse"}).status_code == 404
    with running_server(llm, ServerConfig()) as url:
        off = httpx.post(url + "/v1/load_lora_adapter", json=load)
        assert off.status_code == 404 and "--allow-runtime-lora-updating" in off.json()["error"]["message"]


def test_the_model_diff_example(smol4_path, tmp_path):
    """examples/lora_model_diff.py on SmolLM2's first four layers with an adapter of its layers 2 and 3: no change of
    the residual stream before layer 2, a change from there on; per layer and the next token's KL as PEFT's model
    computes them."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("lora_model_diff", Path(__file__).parent.parent / "examples" /
                                                  "lora_model_diff.py")  # fmt: skip
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                        layers_to_transform=[2, 3], init_lora_weights=False)  # fmt: skip
    model = get_peft_model(_base(str(smol4_path)), config).eval()
    model.save_pretrained(tmp_path / "late")
    llm = LLM(str(smol4_path), dtype="float32", device="cpu", enable_lora=True)
    change, kl = example.model_diff(llm, LoRARequest("late", 1, str(tmp_path / "late")), example.PROMPTS)
    assert max(change[:2]) < 1e-6 < min(change[2:])
    tokenizer = AutoTokenizer.from_pretrained(smol4_path)
    want, logits = [], []
    for prompt in example.PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad(), model.disable_adapter():
            before = model(ids, output_hidden_states=True)
        with torch.no_grad():
            after = model(ids, output_hidden_states=True)
        want.append([((a[0, -1] - b[0, -1]).norm() / b[0, -1].norm()).item()
                     for a, b in zip(after.hidden_states[1:], before.hidden_states[1:])])  # fmt: skip
        logits.append((before.logits[0, -1].double().log_softmax(-1), after.logits[0, -1].double().log_softmax(-1)))
    want = torch.tensor(want).mean(0)  # (HF's last hidden state is after the final norm: layers 0-2 compared)
    want_kl = torch.stack([(p.exp() * (p - q)).sum() for p, q in logits]).mean().item()
    assert torch.allclose(torch.tensor(change[:3]), want[:3], rtol=1e-4, atol=1e-7)
    assert abs(kl - want_kl) < 1e-4 * max(1, want_kl)
