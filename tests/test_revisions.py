"""A hub model's other versions: `revision=` (a branch, tag or commit, as HF's from_pretrained and vLLM take it) in
`LLM`, tensor parallelism, harvest and the command line, and TransformerLens's model names and Pythia checkpoint
numbers in `HookedLM.from_pretrained`; each read from an offline HF cache that holds two versions, so nothing
touches the network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import rel_err, save_tiny
from transformers import AutoModelForCausalLM, GPTNeoConfig, GPTNeoXConfig, LlamaConfig

import vlens.cli
from vlens import LLM, HookedLM, harvest
from vlens.harvest.model import weights_hash
from vlens.hooked import hub_id
from vlens.loader import ModelLoadError

IDS = [[5, 17, 42, 99, 7, 250, 3, 3, 8], [11, 12]]
SIZES = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "max_position_embeddings": 64}  # fmt: skip


def cache_repo(hf_home: Path, repo_id: str, versions: dict[str, str]) -> dict[str, Path]:
    """`repo_id` in an HF hub cache under `hf_home`, one snapshot per version (name -> checkpoint directory), its
    ref naming the snapshot's commit, as `hf download --revision` leaves them. The snapshots by version name."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    snapshots = {}
    for i, (name, checkpoint) in enumerate(versions.items()):
        commit = f"{i + 1:040x}"
        snapshots[name] = shutil.copytree(checkpoint, repo / "snapshots" / commit)
        (repo / "refs" / name).write_text(commit)
    return snapshots


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch) -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


@pytest.fixture()
def two_versions(offline_hub, tmp_path) -> dict[str, Path]:
    """vlens-test/tiny: main a 2-layer Llama, step1000 a 3-layer one (other weights, another config)."""
    main = save_tiny(LlamaConfig(**SIZES, num_hidden_layers=2), tmp_path / "main")
    step = save_tiny(LlamaConfig(**SIZES, num_hidden_layers=3), tmp_path / "step1000")
    return cache_repo(offline_hub, "vlens-test/tiny", {"main": main, "step1000": step})


def hf_logits(path: Path) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([ids])).logits[0] for ids in IDS]


def check_logits(llm: LLM, snapshot: Path) -> None:
    assert llm.model_path.resolve() == snapshot.resolve()
    for got, ref in zip(llm.trace(IDS, hooks="unembed.hook_out"), hf_logits(snapshot)):
        assert rel_err(got["unembed.hook_out"], ref) <= 1e-5


def test_a_revision_loads_its_snapshot(two_versions):
    check_logits(LLM("vlens-test/tiny", dtype="float32", device="cpu"), two_versions["main"])
    llm = LLM("vlens-test/tiny", revision="step1000", dtype="float32", device="cpu")
    assert llm.config.num_layers == 3 and llm.model_name == "vlens-test/tiny"
    check_logits(llm, two_versions["step1000"])
    by_commit = two_versions["step1000"].name  # a commit hash is a revision too
    check_logits(LLM("vlens-test/tiny", revision=by_commit, dtype="float32", device="cpu"), two_versions["step1000"])


def test_every_rank_loads_the_revision(two_versions):
    with LLM("vlens-test/tiny", revision="step1000", dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        check_logits(llm, two_versions["step1000"])


def test_a_harvest_of_a_revision_names_it(two_versions, tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"tokens": ids}) + "\n" for ids in IDS))
    out = tmp_path / "run"
    harvest("vlens-test/tiny", source, "blocks.2.hook_resid_post", out, revision="step1000", context_size=8,
            model_dtype="float32", device="cpu", progress=False)  # fmt: skip
    model = json.loads((out / "manifest.json").read_text())["model"]
    assert model["revision"] == "step1000" and model["weights_sha256"] == weights_hash(two_versions["step1000"])
    llm = LLM("vlens-test/tiny", revision="step1000", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"^revision: picks a version of a hub model named by `model`"):
        harvest(llm, source, "blocks.2.hook_resid_post", tmp_path / "other", revision="step1000")


def test_the_command_line_takes_a_revision(two_versions, capsys):
    assert vlens.cli.main(["hooks", "--model", "vlens-test/tiny", "--revision", "step1000"]) == 0
    assert "blocks.2.hook_resid_post" in capsys.readouterr().out
    assert vlens.cli.main(["hooks", "--model", "vlens-test/tiny"]) == 0
    assert "blocks.2.hook_resid_post" not in capsys.readouterr().out


def test_listing_a_hub_model_s_hooks_fetches_its_config_alone(offline_hub, tmp_path, monkeypatch, capsys):
    """`vlens hooks` reads the config: of a hub model it asks the hub for config.json only (a 70B model's hooks
    cost no weight download); here the cache holds nothing else."""
    import huggingface_hub

    config = tmp_path / "config-only"
    config.mkdir()
    LlamaConfig(**SIZES, num_hidden_layers=5).save_pretrained(config)
    cache_repo(offline_hub, "vlens-test/big", {"main": config})
    asked = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: asked.append(kw["allow_patterns"])
                        or real(*a, **kw))  # fmt: skip
    assert vlens.cli.main(["hooks", "--model", "vlens-test/big"]) == 0
    assert "blocks.4.hook_resid_post" in capsys.readouterr().out and asked == [["config.json"]]


def test_pythia_checkpoints_by_transformer_lens_s_numbers(offline_hub, tmp_path):
    """HookedTransformer.from_pretrained(name, checkpoint_value=1000) or checkpoint_index=11 (the twelfth in its list
    of Pythia checkpoints: 0, 1, 2, 4, ..., 512, 1000, ...) is the hub revision step1000."""
    neox = dict(SIZES, num_hidden_layers=2, rotary_pct=0.25)
    versions = {"main": save_tiny(GPTNeoXConfig(**neox), tmp_path / "main"),
                "step1000": save_tiny(GPTNeoXConfig(**(neox | {"num_hidden_layers": 3})), tmp_path / "step1000")}
    snapshots = cache_repo(offline_hub, "EleutherAI/pythia-vlens-test", versions)
    for numbers in ({"checkpoint_value": 1000}, {"checkpoint_index": 11}):
        model = HookedLM.from_pretrained("EleutherAI/pythia-vlens-test", dtype="float32", device="cpu", **numbers)
        check_logits(model.llm, snapshots["step1000"])
    errors = [
        ({"checkpoint_value": 1500}, r"^checkpoint_value: 1500 is not one of Pythia's checkpoints"),
        ({"checkpoint_index": 154}, r"^checkpoint_index: 154 is not in 0\.\.153"),
        ({"checkpoint_index": 11, "checkpoint_value": 1000}, r"^checkpoint_index, checkpoint_value, revision: give one"),
        ({"checkpoint_value": 1000, "revision": "main"}, r"^checkpoint_index, checkpoint_value, revision: give one"),
    ]
    for numbers, message in errors:
        with pytest.raises(ValueError, match=message):
            HookedLM.from_pretrained("EleutherAI/pythia-vlens-test", **numbers)
    with pytest.raises(ValueError, match=r"^checkpoint_index / checkpoint_value: .* are Pythia's .*revision='...'"):
        HookedLM.from_pretrained("vlens-test/tiny", checkpoint_value=1000)


def test_transformer_lens_model_names(offline_hub, tmp_path):
    """HookedTransformer.from_pretrained("pythia-70m", checkpoint_index=11) and ("tiny-stories-1M"): TransformerLens's
    names of hub models, read from its own table, load the models they stand for (here from an offline hub cache);
    a path, an org/name id or a name it does not know is left as it is."""
    neox = dict(SIZES, num_hidden_layers=2, rotary_pct=0.25)
    versions = {"main": save_tiny(GPTNeoXConfig(**neox), tmp_path / "main"),
                "step1000": save_tiny(GPTNeoXConfig(**(neox | {"num_hidden_layers": 3})), tmp_path / "step1000")}
    pythia = cache_repo(offline_hub, "EleutherAI/pythia-70m", versions)
    check_logits(HookedLM.from_pretrained("pythia-70m", checkpoint_index=11, dtype="float32", device="cpu").llm,
                 pythia["step1000"])  # fmt: skip
    neo = GPTNeoConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64,
                       attention_types=[[["global", "local"], 1]], window_size=4)  # fmt: skip
    stories = cache_repo(offline_hub, "roneneldan/TinyStories-1M", {"main": save_tiny(neo, tmp_path / "neo")})
    check_logits(HookedLM.from_pretrained("tiny-stories-1M", dtype="float32", device="cpu").llm, stories["main"])
    assert [hub_id(name) for name in ("gpt2-small", "gemma-2-2b", "org/name", "no-such-model", str(tmp_path))] == [
        "gpt2", "google/gemma-2-2b", "org/name", "no-such-model", str(tmp_path)]  # fmt: skip


def test_a_revision_that_cannot_be_had_is_named(two_versions, tmp_path):
    with pytest.raises(ModelLoadError) as err:
        LLM("vlens-test/tiny", revision="step2000", dtype="float32", device="cpu")
    assert "'vlens-test/tiny' at revision 'step2000'" in str(err.value)
    assert "hf download vlens-test/tiny --revision step2000" in str(err.value)  # how to fetch it
    local = two_versions["main"]
    with pytest.raises(ModelLoadError, match=r"^revision: 'step1000' picks a version of a hub model .*; the model is '"):
        LLM(str(local), revision="step1000")
    with pytest.raises(ModelLoadError, match=r"^revision: 'step1000' .* the model is the embedded default"):
        LLM(revision="step1000")
