"""Every way in for a checkpoint (sharded directory, GGUF, hub id, the default) and every way it can fail.

Errors must be vlens's own (ModelLoadError, UnsupportedModelError, ValueError) and name what was asked for
and what to do; nothing here touches the network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import rel_err, save_tiny, weight_digests
from transformers import (
    AutoModelForCausalLM,
    BitNetConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OpenAIGPTConfig,
    Phi3Config,
    Qwen2Config,
)

import vlens
import vlens.cli
from vlens import LLM
from vlens.config import ModelConfig, UnsupportedModelError
from vlens.loader import LoadedModel, ModelLoadError, default_gguf
from vlens.models.llama import CausalLM

IDS = [[5, 17, 42, 99, 7, 250, 3, 3, 8], [11, 12]]


def tiny_config(**overrides) -> LlamaConfig:
    kw = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return LlamaConfig(**(kw | overrides))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A one-file tiny Llama checkpoint; tests that alter a checkpoint copy it first."""
    return Path(save_tiny(tiny_config(), tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(scope="module")
def tiny_logits(tiny) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([ids])).logits[0] for ids in IDS]


def logits(llm: LLM) -> list[torch.Tensor]:
    return [o["unembed.hook_out"] for o in llm.trace(IDS, hooks="unembed.hook_out")]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- what loads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        tiny_config(),
        GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64),
        GPTNeoXConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
    ],
    ids=["llama", "gpt2", "gpt_neox"],
)
def test_sliding_window_ignored_where_hf_ignores_it(config, tmp_path):
    """HF's Llama, GPT-2 and NeoX attend over every earlier token whatever config.json says of a window (a
    stray "sliding_window" key is kept on the config object); vlens windowed them, past 3 tokens here."""
    path = Path(save_tiny(config, tmp_path / "ckpt"))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"sliding_window": 3}))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    assert llm.config.sliding_windows == (None, None)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS[0]])).logits[0]
    assert rel_err(logits(llm)[0], ref) <= 1e-5


def test_load_model_returns_its_parts(tiny):
    loaded = vlens.load_model(str(tiny), dtype="float32", device="cpu")
    assert isinstance(loaded, LoadedModel)
    assert isinstance(loaded.model, CausalLM) and isinstance(loaded.config, ModelConfig)
    assert loaded.config.architecture == "LlamaForCausalLM" and loaded.config.num_layers == 2
    assert loaded.tokenizer is None  # no tokenizer files in a save_pretrained of a bare model
    assert loaded.path == tiny and loaded.name == str(tiny)
    assert not loaded.model.training
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in loaded.model.parameters())
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert not any(p.is_meta for p in loaded.model.parameters())


def test_sharded_checkpoint_with_index(tiny, tiny_logits, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(sharded.glob("*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    llm = LLM(model=str(sharded), dtype="float32", device="cpu")
    one_file = LLM(model=str(tiny), dtype="float32", device="cpu")
    for a, b in zip(llm.model.state_dict().values(), one_file.model.state_dict().values()):
        assert torch.equal(a, b)
    for got, ref in zip(logits(llm), tiny_logits):
        assert rel_err(got, ref) <= 1e-5


def test_index_decides_which_shards_are_read(tiny, tmp_path):
    """A stray *.safetensors beside an index (an old consolidated file, say) is not read."""
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    (sharded / "zz-stray.safetensors").write_bytes(b"not a safetensors file")
    LLM(model=str(sharded), dtype="float32", device="cpu")


def test_relative_directory_that_looks_like_a_hub_id_is_local(tiny, tmp_path, monkeypatch):
    copy_checkpoint(tiny, tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert vlens.load_model("org/name", dtype="float32", device="cpu").path == Path("org/name")


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("auto", torch.float32),  # CPU: float32; bfloat16 is for GPUs
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype(tiny, dtype, expected):
    llm = LLM(model=str(tiny), dtype=dtype, device="cpu")
    assert llm.dtype == expected
    assert all(p.dtype == expected for p in llm.model.parameters())
    out = llm.trace(IDS[:1], hooks=["blocks.0.hook_resid_post", "unembed.hook_out"])[0]
    assert all(v.dtype == expected for v in out.values())


def test_gguf_is_converted_once_and_cached(gguf_first_use, smol):
    """A .gguf is dequantised into $VLENS_CACHE on first use; later loads (of it or the default) reuse it.

    The first use is the session's (conftest.gguf_first_use): the run converts the file once, whether for
    this test alone or also for the `smol` every other test reads."""
    use, gguf = gguf_first_use, default_gguf()
    assert gguf.is_file() and gguf.suffix == ".gguf"

    first, converted = use.first, use.first.path
    assert use.conversions[0] == [gguf.name]
    assert converted.parent == use.cache / "gguf" and converted.name not in use.entries_before
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(use.files)
    assert use.entries_after == use.entries_before | {converted.name}  # no temporary directory left
    assert first.name == str(gguf) and first.tokenizer is not None

    assert use.default_path == use.second_path == converted  # the default model is this GGUF
    assert use.conversions[1] == []  # neither converted again
    assert use.files_after_second == use.files

    # Converted in an empty cache, the file gives the weights the session's `smol` was loaded with (from the
    # cache the user already had, unless this run made it).
    assert use.weights == weight_digests(smol.model)
    ids = first.tokenizer("The capital of France is")["input_ids"]
    assert ids == smol.tokenizer("The capital of France is")["input_ids"]


def test_hub_id_found_in_the_offline_cache(tiny, tiny_logits, tmp_path, monkeypatch):
    """Offline, a hub id resolves to its snapshot in HF_HOME, read at call time (not at import)."""
    repo = tmp_path / "hf" / "hub" / "models--vlens-test--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    copy_checkpoint(tiny, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(model="vlens-test/tiny-llama", dtype="float32", device="cpu")
    assert llm.model_path.resolve() == (repo / "snapshots" / commit).resolve()
    assert llm.model_name == "vlens-test/tiny-llama"
    for got, ref in zip(logits(llm), tiny_logits):
        assert rel_err(got, ref) <= 1e-5


# --- what fails, and how -----------------------------------------------------------------------------


def test_hub_id_offline_and_not_cached(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        vlens.load_model("vlens-test/not-downloaded", dtype="float32", device="cpu")
    message = str(err.value)
    assert "'vlens-test/not-downloaded'" in message
    assert "hf download vlens-test/not-downloaded" in message  # how to fetch it
    assert not (tmp_path / "hf" / "hub" / "models--vlens-test--not-downloaded" / "snapshots").exists()


@pytest.mark.parametrize(
    ("config", "arch"),
    [
        (BitNetConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2), "BitNetForCausalLM"),  # fmt: skip
        (OpenAIGPTConfig(vocab_size=300, n_embd=32, n_layer=1, n_head=2), "OpenAIGPTLMHeadModel"),
    ],
)
def test_unsupported_architecture(config, arch, tmp_path):
    path = save_tiny(config, tmp_path / "ckpt")
    with pytest.raises(UnsupportedModelError) as err:
        LLM(model=path, dtype="float32", device="cpu")
    message = str(err.value)
    assert arch in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message
    assert isinstance(err.value, ValueError)


SIZES = {k: getattr(tiny_config(), k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
SIZES |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize(
    ("config", "stray"),
    [
        (MistralConfig(**SIZES), {"attention_bias": True}),
        (MixtralConfig(**SIZES, num_local_experts=2), {"attention_bias": True}),
        (Phi3Config(**SIZES, pad_token_id=0), {"attention_bias": True}),
        (Qwen2Config(**SIZES), {"mlp_bias": True}),
    ],
    ids=["mistral", "mixtral", "phi3", "qwen2"],
)
def test_bias_flags_read_only_where_hf_reads_them(config, stray, tmp_path):
    """Only Llama's HF MLP reads mlp_bias, and Mistral, Mixtral and Phi-3 have no attention biases whatever
    attention_bias says; vlens read both for all of them and refused such checkpoints, which HF loads, for
    lacking the biases."""
    path = Path(save_tiny(config, tmp_path / "ckpt"))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | stray))
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS[0]])).logits[0]
    assert rel_err(logits(llm)[0], ref) <= 1e-5


@pytest.mark.parametrize(
    "extra",
    [{}, {"auto_map": {"AutoConfig": "configuration_mine.MyConfig", "AutoModelForCausalLM": "modeling_mine.MyLM"}}],
    ids=["unknown_model_type", "custom_code"],
)
def test_architecture_transformers_does_not_know(extra, tiny, tmp_path, monkeypatch, capsys):
    """Refused by vlens, from config.json, before transformers parses it: AutoConfig answered with advice to
    upgrade transformers, or to pass trust_remote_code=True (which vlens has no option for) after asking on stdin."""
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked on stdin"))
    path = copy_checkpoint(tiny, tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"model_type": "mine", "architectures": ["MyLM"]} | extra))
    refusal = "architecture 'MyLM' (model_type 'mine') is not supported by vlens; supported architectures: Afmoe"
    with pytest.raises(UnsupportedModelError) as err:
        LLM(model=str(path), dtype="float32", device="cpu")
    assert refusal in str(err.value)
    assert vlens.cli.main(["hooks", "--model", str(path)]) == 2  # `vlens hooks` reads only the config
    assert refusal in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["absolute", "relative", "gguf"])
def test_missing_path(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = {"absolute": str(tmp_path / "nowhere"), "relative": "nowhere", "gguf": str(tmp_path / "m.gguf")}[kind]
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        vlens.load_model(name, dtype="float32", device="cpu")
    assert repr(name) in str(err.value)


def test_file_that_is_not_a_checkpoint(tmp_path):
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="neither a checkpoint directory nor a .gguf file"):
        vlens.load_model(str(bogus), dtype="float32", device="cpu")


def test_directory_without_config(tiny, tmp_path):
    path = copy_checkpoint(tiny, tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="has no config.json") as err:
        vlens.load_model(str(path), dtype="float32", device="cpu")
    assert str(path) in str(err.value)


def test_directory_without_weights(tiny, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(tiny / "config.json", path)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights") as err:
        vlens.load_model(str(path), dtype="float32", device="cpu")
    assert str(path) in str(err.value)


def test_checkpoint_missing_a_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny, tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks weights") as err:
        vlens.load_model(str(path), dtype="float32", device="cpu")
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)


def test_config_and_weights_disagree_on_a_shape(tiny, tmp_path):
    path = copy_checkpoint(tiny, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 1  # every MLP weight would broadcast into [1, 64] or [64, 1] silently
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="shape") as err:
        vlens.load_model(str(path), dtype="float32", device="cpu")
    assert "mlp" in str(err.value)


def _as_fp8(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """A copy of the checkpoint as DeepSeek-V3's releases store one: each layer's projection in float8 (E4M3), one
    float32 scale_inv a block of `block` (the last of a side partial where the block does not divide it), config.json
    saying so; its dequantised weights, as HF's dequantize=True makes them, in `dst`/"dequantised", unquantised."""
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(src, dst)
    weights, plain = load_file(path / "model.safetensors"), {}
    for key, w in list(weights.items()):
        if ".layers." not in key or w.dim() != 2:
            continue
        (rows, cols), (bm, bn) = w.shape, block
        grid = torch.nn.functional.pad(w, (0, -cols % bn, 0, -rows % bm)).unflatten(0, (-1, bm)).unflatten(2, (-1, bn))
        scale = grid.abs().amax(dim=(1, 3)) / 448  # (E4M3's largest)
        weights[key] = (w / scale.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]).to(
            torch.float8_e4m3fn)  # fmt: skip
        weights[key + "_scale_inv"] = scale
        plain[key] = weights[key].float() * scale.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    dequantised = copy_checkpoint(src, dst / "dequantised")
    save_file(load_file(src / "model.safetensors") | plain, dequantised / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_fp8_checkpoint_in_blocks_is_dequantised(tiny, tmp_path):
    """Blocks of 24 x 40 (64 and 96 rows and columns: partial last blocks): the model of the dequantised weights,
    tap for tap; the weights moved from the originals, as FP8 rounds them."""
    path = _as_fp8(tiny, tmp_path / "fp8", (24, 40))
    fp8, plain = LLM(model=str(path), dtype="float32", device="cpu"), LLM(model=str(path / "dequantised"),
                                                                          dtype="float32", device="cpu")  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(logits(fp8), logits(plain)))
    original = LLM(model=str(tiny), dtype="float32", device="cpu").model.layers[0].mlp.down_proj.weight
    moved = (fp8.model.layers[0].mlp.down_proj.weight - original).abs().max()
    assert 0 < moved < 0.1 * original.abs().max()


@pytest.mark.parametrize(("quant", "named"), [({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
                                              ({"quant_method": "fp8"}, "'fp8' without weight_block_size")])
def test_checkpoint_quantised_otherwise_is_refused(tiny, tmp_path, quant, named):
    path = copy_checkpoint(tiny, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    with pytest.raises(UnsupportedModelError, match=named):
        vlens.load_model(str(path), dtype="float32", device="cpu")


@pytest.mark.parametrize("dtype", ["float64", "fp32", "int8", torch.float64, None])
def test_bad_dtype(dtype, tiny):
    with pytest.raises(ValueError, match="dtype") as err:
        vlens.load_model(str(tiny), dtype=dtype, device="cpu")
    assert "bfloat16" in str(err.value)  # the valid ones are listed


@pytest.mark.parametrize("device", ["tpu", "mps", "gpu:0", ""])
def test_bad_device(device, tiny):
    with pytest.raises(ValueError, match="device") as err:
        LLM(model=str(tiny), dtype="float32", device=device)
    assert "cpu" in str(err.value) and "cuda" in str(err.value)


def test_cuda_asked_for_without_cuda(tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device: 'cuda:0'"):
        vlens.load_model(str(tiny), dtype="float32", device="cuda:0")
    assert vlens.load_model(str(tiny), dtype="auto", device="auto").model.lm_head.weight.device.type == "cpu"


def test_options_are_checked_before_anything_is_read(monkeypatch):
    """Cheap mistakes fail at once: no model is looked for, converted or downloaded first."""
    monkeypatch.setattr(vlens.loader, "resolve_model_path", lambda model: pytest.fail("model was resolved"))
    with pytest.raises(ValueError, match="dtype"):
        vlens.load_model(None, dtype="float64", device="cpu")
    with pytest.raises(ValueError, match="device"):
        vlens.load_model(None, dtype="float32", device="tpu")


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type 'dynamic'"),
        ({"hidden_act": "quick_gelu"}, "hidden_act 'quick_gelu'"),
    ],
)
def test_unsupported_variant_of_a_supported_architecture(overrides, named, tmp_path):
    path = save_tiny(tiny_config(**overrides), tmp_path / "ckpt")
    with pytest.raises(UnsupportedModelError) as err:
        vlens.load_model(path, dtype="float32", device="cpu")
    assert named in str(err.value) and "supported: " in str(err.value)
