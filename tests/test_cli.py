"""The `vlens` command on the default model: what it prints, what it writes, how it fails."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from safetensors import safe_open
from safetensors.torch import load_file

import vlens.cli
from vlens import SamplingParams
from vlens.cli import main
from vlens.steering import SteeringVector, train_steering_vector

TEXTS = ["The capital of France is", "Hi"]
HOOKS = ["blocks.10.hook_resid_post", "blocks.0.attn.hook_*", "hidden_states.0", "ln_final.hook_normalized"]


def run_main(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(argv)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, smol):
    """One `vlens trace ... --out` run (default model) beside LLM.trace of the same texts."""
    path = tmp_path_factory.mktemp("cli") / "acts.safetensors"
    status, stdout = run_main(["trace", *TEXTS, "--hooks", *HOOKS, "--dtype", "float32", "--out", str(path)])
    assert status == 0
    return stdout, path, smol.trace(TEXTS, HOOKS)


def table(stdout: str) -> dict[int, dict[str, list[str]]]:
    """text index -> hook -> [shape, dtype, mean row norm], read back from the printed tables."""
    tables: dict[int, dict[str, list[str]]] = {}
    for line in stdout.splitlines():
        if line.startswith("text "):
            current = tables.setdefault(int(line.split()[1].rstrip(":")), {})
        elif line.startswith("  ") and line.split()[0] != "hook":
            name, *cells = re.split(r"\s{2,}", line.strip())
            current[name] = cells
    return tables


def test_trace_table_lists_every_hook_with_shape_dtype_and_norm(traced, smol):
    stdout, _, expected = traced
    tables = table(stdout)
    assert sorted(tables) == [0, 1]
    assert "text 0: 'The capital of France is' (5 tokens)" in stdout
    assert "text 1: 'Hi' (1 token)" in stdout
    for i, text in enumerate(TEXTS):
        n = len(smol.tokenizer(text)["input_ids"])
        rows = tables[i]
        assert list(rows) == list(expected[i])  # forward order; the glob expanded to q, k, v, scores, pattern, z
        assert rows["blocks.10.hook_resid_post"][0] == f"({n}, 576)"
        assert rows["blocks.0.attn.hook_q"][0] == f"({n}, 9, 64)"
        assert rows["blocks.0.attn.hook_k"][0] == f"({n}, 3, 64)"
        for name, t in expected[i].items():
            assert rows[name][1] == "float32"
            assert float(rows[name][2]) == pytest.approx(t.flatten(1).norm(dim=1).mean().item(), abs=1e-4)


def test_trace_file_holds_the_same_tensors_as_llm_trace(traced, smol):
    _, path, expected = traced
    saved = load_file(path)
    ids = [smol.tokenizer(text)["input_ids"] for text in TEXTS]
    assert set(saved) == set(expected[0]) | {"token_ids", "sequence", "position"}
    assert saved["token_ids"].tolist() == [t for seq in ids for t in seq]
    assert saved["sequence"].tolist() == [i for i, seq in enumerate(ids) for _ in seq]
    assert saved["position"].tolist() == [p for seq in ids for p in range(len(seq))]
    for i in range(len(TEXTS)):
        for name, t in expected[i].items():
            rows = saved[name][saved["sequence"] == i]
            if name.endswith(("hook_pattern", "hook_attn_scores")):  # widened to the longest text's keys
                fill = 0.0 if name.endswith("hook_pattern") else float("-inf")
                assert (rows[..., t.shape[-1] :] == fill).all()
                rows = rows[..., : t.shape[-1]]
            assert torch.equal(rows, t), (i, name)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert json.loads(meta["texts"]) == TEXTS
    assert meta["model"] == "SmolLM2-135M-Instruct"


def test_hooks_lists_every_name_with_its_shape(smol):
    status, stdout = run_main(["hooks"])
    assert status == 0
    listed = dict(line.split(None, 1) for line in stdout.splitlines())
    assert listed["blocks.29.hook_resid_post"] == "(576,)"
    assert listed["blocks.0.attn.hook_k"] == "(3, 64)"
    assert listed["unembed.hook_out"] == f"({smol.config.vocab_size},)"
    assert listed == {name: str(shape) for name, shape in smol.hook_names().items()}


def test_hooks_read_the_config_under_hf_overrides(smol4_path):
    """--hf-overrides (vLLM's) changes the config whose hooks are listed: two of smol4's four layers; read as a
    classifier, no unembedding's hook."""
    overrides = '{"num_hidden_layers": 2, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}'
    status, stdout = run_main(["hooks", "--model", str(smol4_path), "--hf-overrides", overrides])
    listed = dict(line.split(None, 1) for line in stdout.splitlines())
    assert status == 0 and "blocks.1.hook_resid_post" in listed and "blocks.2.hook_resid_post" not in listed
    assert "unembed.hook_out" not in listed and "ln_final.hook_out" in listed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trace", "x", "--hooks", "hook_embed", "--dtype", "int8"], "dtype: 'int8' is not one of auto, float32"),
        (["hooks", "--hf-overrides", "[1]"], "hf_overrides: expected a dict of names (a JSON object), got [1]"),
        (["trace", "x", "--hooks", "hook_embed", "--device", "tpu"], "device: 'tpu' is not one of auto, cpu, cuda"),
        (["hooks", "--model", "{tmp}/missing"], "/missing' does not exist (expected a directory, .gguf file"),
        (["hooks", "--model", "{tmp}"], "has no config.json; is it a HF checkpoint?"),
        (["trace", "x", "--hooks", "hook_embed", "--out", "{tmp}/no/a.st"], "--out: the directory of '{tmp}/no/a.st'"),
        (["generate", "x", "--capture", "hook_embed", "--out", "{tmp}/no/a.st"], "--out: the directory of"),
        (["generate", "x", "--out", "{tmp}/a.st"], "--out: give --capture or --sae too"),
        (["generate", "x", "--max-tokens", "-1"], "max_tokens: -1 is not allowed; expected an int >= 0"),
        (["generate", "x", "--temperature", "-1"], "temperature: -1.0 is not allowed; expected >= 0"),
        (["lens", "x", "--out", "{tmp}/a.html", "--max-tokens", "-1"], "--max-tokens: must be an integer >= 0, got -1"),
        (["lens", "x", "--out", "{tmp}/a.html", "--top-k", "0"], "--top-k: must be an integer >= 1, got 0"),
        (["lens", "x", "--out", "{tmp}"], "--out: '{tmp}' is a directory; give the path of the file to write"),
        (["lens", "x", "--out", "{tmp}/a.html", "--attention-layers", "3", "30"],
         "--attention-layers: 30 is not a layer of this model (0 .. 29)"),
        (["generate", "x", "--multiplier", "2"], "--multiplier: scales --steering-vector; give one"),
        (["generate", "x", "--steering-vector", "{tmp}/v.st"], "steering_vector: '{tmp}/v.st' is not a readable"),
        (["steering-vector", "{tmp}/p.jsonl", "--hooks", "hook_embed", "--out", "{tmp}/v.st"],
         "pairs: '{tmp}/p.jsonl' is not a file"),
        (["steering-vector", "--out", "{tmp}/v.st"],
         "pairs: give PAIRS (a JSON-lines file of contrastive pairs) or --from-harvests POS NEG"),
        (["steering-vector", "{tmp}/p.jsonl", "--out", "{tmp}/v.st"], "hooks: required with PAIRS"),
        (["steering-vector", "--from-harvests", "{tmp}", "{tmp}", "--out", "{tmp}/v.st"],
         "out_dir: '{tmp}' holds no manifest.json; is it a vlens harvest directory?"),
        (["harvest", "--source", "{tmp}/a.txt", "--hooks", "hook_embed", "--out", "{tmp}/o", "--pool", "last"],
         "pool: 'last' takes one row per document, which needs pack=False (--no-pack)"),
        (["harvest", "--source", "{tmp}/a.txt", "--hooks", "hook_embed", "--out", "{tmp}/o", "--temperature", "1"],
         "temperature: samples the continuations of generate_tokens; give it too"),
        (["hooks", "--revision", "step1000"],
         "revision: 'step1000' picks a version of a hub model (org/name); the model is the embedded default"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vlens.cli, "LLM", None)  # each fails before a model loads
    status = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("vlens: error: ") and err.count("\n") == 1
    assert message.format(tmp=tmp_path) in err


def test_a_steering_vector_trained_from_pairs_then_steers_generate(smol4, smol4_path, tmp_path, capsys):
    pairs = [("I love this film, it was wonderful", "I hate this film, it was dreadful"),
             ("She thanked him warmly", "She insulted him coldly"),
             ("What a great day", "What an awful day")]  # fmt: skip
    lines = tmp_path / "pairs.jsonl"
    lines.write_text("\n".join(json.dumps({"positive": p, "negative": n}) for p, n in pairs) + "\n\n")
    path, model = tmp_path / "kind.safetensors", ["--model", str(smol4_path), "--dtype", "float32"]
    status, stdout = run_main(["steering-vector", str(lines), "--hooks", "blocks.{1,2}.hook_resid_post", "--out",
                               str(path), *model])  # fmt: skip
    assert status == 0 and stdout.endswith(f"wrote {path}: 2 vectors from 3 pairs\n")
    expected = train_steering_vector(smol4, pairs, "blocks.{1,2}.hook_resid_post")
    written = SteeringVector.load(path).vectors
    assert written.keys() == expected.vectors.keys()
    assert all(rel_err(written[hook], v) < 1e-6 for hook, v in expected.vectors.items())
    prompt = "My day at work was"
    status, stdout = run_main(["generate", prompt, "--max-tokens", "6", "--steering-vector", str(path),
                               "--multiplier", "8", *model])  # fmt: skip
    [steered, plain] = [
        smol4.generate(prompt, SamplingParams(max_tokens=6, temperature=0, interventions=ivs), use_tqdm=False)[0]
        for ivs in (expected.steers(8.0), [])
    ]
    text = steered.outputs[0].text
    assert status == 0 and f": {text!r}" in stdout and text != plain.outputs[0].text
    lines.write_text('{"positive": "a", "negative": 3}\n')
    assert main(["steering-vector", str(lines), "--hooks", "hook_embed", "--out", str(path), *model]) == 2
    assert 'pairs: line 1 of' in capsys.readouterr().err


def test_bad_hook_exits_2_naming_the_closest_hooks(smol4_path):
    """Through the installed entry point: status 2, one line on stderr, no traceback. The model is SmolLM2 cut
    to four layers (conftest.smol4_path), a third of the weights for the child process to load."""
    vlens = Path(sys.executable).parent / "vlens"
    argv = [str(vlens), "trace", "Hello", "--model", str(smol4_path), "--hooks", "blocks.30.hook_resid_post"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("vlens: error: hooks: 'blocks.30.hook_resid_post' matches no hook of this model")
    assert "closest valid names: blocks.3.hook_resid_post" in done.stderr


def test_harvest_and_export_are_subcommands(capsys):
    for command in ("harvest", "export"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "usage: vlens harvest" in shown and "--source" in shown
    assert "usage: vlens export" in shown and "--format" in shown


def test_python_m_vlens_cli_runs_the_command(smol4_path):
    """`python -m vlens.cli` is the installed `vlens` script (it used to exit 0 having done nothing)."""
    argv = [sys.executable, "-m", "vlens.cli", "hooks", "--model", str(smol4_path)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split() == ["hook_embed", "(576,)"]


def test_a_command_ends_without_triton_teardown_noise(smol4_path):
    """Triton 3.9's bindings print 'nanobind: leaked ...' lines as the interpreter ends (a few dozen after
    `vlens generate`); a command that has done its work ends without them."""
    argv = [sys.executable, "-m", "vlens.cli", "generate", "Hello", "--model", str(smol4_path), "--max-tokens", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=Path(__file__).parents[1])
    assert done.returncode == 0 and "completion (2 tokens, length)" in done.stdout, done.stderr
    assert "nanobind" not in done.stderr and "leaked" not in done.stderr


def test_ctrl_c_is_one_line_with_the_status_of_sigint(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(vlens.cli, "model_config", interrupted)
    assert main(["hooks"]) == 130
    assert capsys.readouterr().err == "vlens: interrupted\n"


def test_generate_help_shows_the_sampling_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--max-tokens MAX_TOKENS tokens to generate per prompt (default: 32)" in shown
    assert "--temperature TEMPERATURE sampling temperature (default: 0, greedy)" in shown


def test_make_demo_runs_the_command_the_readme_shows():
    """README's Generation section shows "the command `make demo` runs"; the Makefile's MAIN_JOB is it."""
    root = Path(__file__).resolve().parents[1]
    [job] = re.findall(r"^MAIN_JOB := (.*)$", (root / "Makefile").read_text(), re.M)
    readme = (root / "README.md").read_text()
    [shown] = re.findall(r"the command `make demo` runs\):\n\n```sh\nvlens (.*?)\n```", readme, re.S)
    shown = " ".join(shown.replace("\\\n", " ").split())
    assert shown.startswith(" ".join(job.split())), (job, shown)
