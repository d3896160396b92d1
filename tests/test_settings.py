"""Settings declared once (vlens.settings): a wrong one fails by name before any model is looked for, from
Python and from the command line, and every setting has its flag."""

from __future__ import annotations

import dataclasses
import re

import pytest

import vlens.llm
from vlens import LLM, EngineConfig, HarvestConfig, harvest
from vlens.cli import _parser, main
from vlens.harvest import model as harvest_model
from vlens.server.cli import SHARED
from vlens.server.config import ServerConfig
from vlens.settings import flag_name, from_args


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """Every check here must come before a model is resolved, loaded or converted."""

    def fail(*args, **kwargs):
        pytest.fail("a model was loaded before the settings were checked")

    monkeypatch.setattr(vlens.llm, "load_model", fail)
    monkeypatch.setattr(harvest_model, "load_model", fail)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_num_seq": 4}, r"max_num_seq: unknown setting; known settings: .*max_num_seqs"),
        ({"block_size": 0}, r"block_size: must be an integer >= 1, got 0"),
        ({"max_model_len": 2.5}, r"max_model_len: must be an integer >= 1, got 2\.5"),
        ({"dtype": "fp8"}, r"dtype: 'fp8' is not one of auto, float32, float16, bfloat16"),
        ({"device": "tpu"}, r"device: 'tpu' is not one of auto, cpu, cuda"),
        ({"enable_capture": "yes"}, r"enable_capture: must be true or false, got 'yes'"),
    ],
)
def test_llm_setting_errors_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(**settings)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"context_sizes": 8}, r"context_sizes: unknown setting; known settings: .*context_size"),
        ({"shard_bytes": 0}, r"shard_bytes: must be an integer >= 1, got 0"),
        ({"backend": "dask"}, r"backend: 'dask' is not one of local, ray"),
        ({"workers": 0}, r"workers: must be an integer >= 1, got 0"),
        ({"cpus_per_worker": 0}, r"cpus_per_worker: must be a number > 0, got 0"),
        ({"max_tokens": 4, "context_size": 16}, r"max_tokens: 4 is less than one window \(context_size=16\)"),
        ({"model_dtype": "fp8"}, r"model_dtype: 'fp8' is not one of auto, float32"),
        ({"dtype": "auto"}, r"dtype: 'auto' is not one of float32, float16, bfloat16"),
        ({"device": "gpu"}, r"device: 'gpu' is not one of auto, cpu, cuda"),
        ({"exclude_token_ids": [1, "2"]}, r"exclude_token_ids: must be an integer, got '2'"),
        ({"seed": 1.5}, r"seed: must be an integer, got 1\.5"),
    ],
)
def test_harvest_option_errors_name_the_option(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        harvest(None, tmp_path / "docs.jsonl", "hook_embed", tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_harvest_options_are_stored_as_given_or_as_tuples():
    config = HarvestConfig(source="s", hooks="hook_embed", out_dir="o", exclude_token_ids=[3, 1])
    assert (config.hooks, config.exclude_token_ids) == (("hook_embed",), (3, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--max-num-seqs", "0"], "max_num_seqs: must be an integer >= 1, got 0"),
        (["serve", "--port", "-1"], "port: must be an integer >= 0, got -1"),
        (["serve", "--port", "70000"], "port: must be an integer in 0..65535, got 70000"),
        (["serve", "--activation-ttl", "0"], "activation_ttl_s: must be a number > 0, got 0.0"),
        (["serve", "--api-key", ""], "api_key: must be a non-empty key"),
        (["serve", "--dtype", "fp8"], "dtype: 'fp8' is not one of auto, float32"),
        (["harvest", "--source", "s", "--hooks", "h", "--out", "o", "--context-size", "1"], "context_size: must be"),
        (["harvest", "--source", "s", "--hooks", "h", "--out", "o", "--dtype", "fp8"], "dtype: 'fp8' is not one of"),
        (["harvest", "--source", "s", "--hooks", "h", "--out", "o", "--ray", "--workers", "0"], "workers: must be"),
        (["generate", "hi", "--device", "cuda:x"], "device: 'cuda:x' is not one of auto, cpu, cuda"),
    ],
)
def test_invalid_flags_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlens: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--max-seqs", "4"],
        ["harvest", "--source", "s", "--hooks", "h", "--out", "o", "--context-sise", "8"],
        ["generate", "hi", "--block-size", "8"],  # an engine setting generate has no flag for
    ],
)
def test_unknown_flags_exit_2_naming_them(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert f"vlens: error: unrecognized arguments: {argv[-2]}" in capsys.readouterr().err


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _listed(flag: str, text: str) -> bool:
    return re.search(rf"(^|[\s\[]){re.escape(flag)}([\s\]]|$)", text, re.MULTILINE) is not None


def test_serve_help_lists_every_server_and_engine_setting(capsys):
    shown = _help("serve", capsys)
    fields = [*dataclasses.fields(ServerConfig), *(f for f in dataclasses.fields(EngineConfig) if f.name not in SHARED)]
    missing = [flag_name(f) for f in fields if not _listed(flag_name(f), shown)]
    assert not missing
    # given by the server's flags: --enable-capture (off by default; the engine itself always can), and
    # --reasoning-parser, the server's reading of replies and the engine's structured requests alike
    assert SHARED == {"enable_capture", "reasoning_parser"}
    assert ServerConfig().enable_capture is False
    args = _parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert from_args(EngineConfig, args).reasoning_parser == from_args(ServerConfig, args).reasoning_parser == "qwen3"


def test_harvest_help_lists_every_option(capsys):
    shown = _help("harvest", capsys)
    missing = [flag_name(f) for f in dataclasses.fields(HarvestConfig) if not _listed(flag_name(f), shown)]
    assert not missing
