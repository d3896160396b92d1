"""lm-evaluation-harness against `vlens serve`, run as a user runs it: `lm_eval run --model
local-completions` in a subprocess, on the small local tasks in tests/data/lm_eval (a multiple-choice
task scored by loglikelihood, a generate_until task), once with the remote tokenizer (lm-eval finds
/tokenizer_info and /tokenize and tokenizes through the server) and once with a local HF tokenizer.

Every loglikelihood it records equals HF's (a float32 forward of the same tokens, which lm-eval splits
into context and continuation as below), and every generation equals vlens's offline greedy one. A third run
evaluates a steered model, named by the steering vector the server loaded (`--steering-vector`): its
loglikelihoods are HF's with the vector added by a forward hook.
Nothing is downloaded: the model is the embedded SmolLM2 cut to four layers (conftest.smol4_path, what
is checked holds for any model; the server computes a seventh of the full model's work), the tasks read
local JSONL files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_helpers import vlens_serve
from transformers import AutoModelForCausalLM

from vlens import SamplingParams
from vlens.steering import SteeringVector

ROOT = Path(__file__).resolve().parents[1]
MC = ROOT / "tests/data/lm_eval/mc.jsonl"
TASKS = ("vlens_mc", "vlens_gen")
# `lm_eval ARGS`, lm-eval's own entry point, except that its TaskManager leaves out the index of lm-eval's
# ~14,000 built-in task YAML files (7-14 s a run on a 2-core machine, half of it): these tasks are local.
LM_EVAL = (
    "import sys; from lm_eval.tasks import manager; init = manager.TaskManager.__init__; "
    "manager.TaskManager.__init__ = lambda self, *a, **k: init(self, *a, **({'include_defaults': False} | k)); "
    "from lm_eval.__main__ import cli_evaluate; cli_evaluate()"
)


STEERED = "blocks.2.hook_resid_post"


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    return torch.randn(576, generator=torch.Generator().manual_seed(7)) * 2


@pytest.fixture(scope="module")
def server(smol4_path, vector, tmp_path_factory):
    path = tmp_path_factory.mktemp("steering") / "kind.safetensors"
    SteeringVector({STEERED: vector}).save(path)
    args = ["--model", str(smol4_path), "--dtype", "float32", "--kv-cache-memory", str(64 << 20)]
    args += ["--max-model-len", "512", "--steering-vector", f"kind={path}"]
    with vlens_serve(args) as (url, _):
        yield url


@pytest.fixture(scope="module")
def runs(server, smol4_path, tmp_path_factory):
    """Both lm-eval runs, side by side (their start-up is most of their time): backend -> task -> samples."""
    out = tmp_path_factory.mktemp("lm_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(out / "datasets")}  # fmt: skip
    backends = {"remote": "", "huggingface": f",tokenizer_backend=huggingface,tokenizer={smol4_path}",
                "steered": ",model=kind"}  # fmt: skip
    procs = {}
    for name, extra in backends.items():
        command = [
            sys.executable, "-c", LM_EVAL, "run", "--model", "local-completions",
            "--model_args", f"base_url={server}/v1/completions,num_concurrent=4{extra}",
            "--tasks", *(TASKS[:1] if name == "steered" else TASKS), "--include_path", "tests/data/lm_eval",
            "--batch_size", "8", "--output_path", str(out / name), "--log_samples",
        ]  # fmt: skip
        procs[name] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    results = {}
    for name, proc in procs.items():
        log = proc.communicate(timeout=600)[0].decode()
        assert proc.returncode == 0, log[-3000:]
        if name == "remote":
            assert "Using remote tokenizer backend" in log, log[-3000:]
        results[name] = {
            task: [json.loads(line) for line in next((out / name).rglob(f"samples_{task}_*.jsonl")).open()]
            for task in (TASKS[:1] if name == "steered" else TASKS)
        }
    return results


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (TemplateLM._encode_pair): trailing spaces of the context move to the
    continuation; the whole is tokenized and the context's tokens cut off its front."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    return whole[:start], whole[start:]


def _hf_scores(runs, smol4, smol4_path, steer: torch.Tensor | None = None) -> dict[tuple[str, str], tuple[float, bool]]:
    """(context, continuation) -> HF's (log-likelihood, is greedy), from one right-padded float32
    forward of every pair the multiple-choice run asked for (`steer`: added to layer 2's output)."""
    pairs = [(a["arg_0"], a["arg_1"]) for sample in runs["remote"]["vlens_mc"] for a in sample["arguments"].values()]
    split = [encode_pair(smol4.tokenizer, *pair) for pair in pairs]
    width = max(len(c) + len(t) for c, t in split)
    ids = torch.zeros(len(split), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (c, t) in enumerate(split):
        ids[i, : len(c) + len(t)] = torch.tensor(c + t)
        mask[i, : len(c) + len(t)] = 1
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(smol4_path, dtype=torch.float32).eval()
        if steer is not None:
            hf.model.layers[2].register_forward_hook(lambda module, args, out: out + steer)
        logp = hf(ids, attention_mask=mask).logits.float().log_softmax(-1)
    scores = {}
    for i, (pair, (c, t)) in enumerate(zip(pairs, split)):
        rows = logp[i, len(c) - 1 : len(c) + len(t) - 1]
        targets = torch.tensor(t)
        scores[pair] = (rows.gather(-1, targets[:, None]).sum().item(), bool((rows.argmax(-1) == targets).all()))
    return scores


@pytest.fixture(scope="module")
def hf_scores(runs, smol4, smol4_path, vector) -> dict[str, dict[tuple[str, str], tuple[float, bool]]]:
    """Per run: HF's scores of its model (the steered run's with the vector added)."""
    plain = _hf_scores(runs, smol4, smol4_path)
    return {"remote": plain, "huggingface": plain, "steered": _hf_scores(runs, smol4, smol4_path, vector)}


@pytest.mark.parametrize("backend", ["remote", "huggingface", "steered"])
def test_loglikelihoods_equal_hf(runs, hf_scores, backend):
    samples, scores = runs[backend]["vlens_mc"], hf_scores[backend]
    assert len(samples) == 20
    resps = [(a["arg_0"], a["arg_1"], r[0]) for s in samples for a, r in zip(s["arguments"].values(), s["resps"])]
    assert len(resps) == len(scores) == sum(len(json.loads(line)["choices"]) for line in MC.open())
    if backend == "steered":  # (the vector moves the scores)
        assert max(abs(scores[pair][0] - hf_scores["remote"][pair][0]) for pair in scores) > 0.1
    for context, continuation, (logprob, is_greedy) in resps:
        expected, greedy = scores[context, continuation]
        assert float(logprob) == pytest.approx(expected, abs=1e-4), (context, continuation)
        assert (is_greedy == "True") == greedy


@pytest.mark.parametrize("backend", ["remote", "huggingface"])
def test_generations_equal_offline_greedy(runs, backend, smol4):
    samples = runs[backend]["vlens_gen"]
    assert len(samples) == 5
    args = [s["arguments"]["gen_args_0"] for s in samples]
    options = args[0]["arg_1"]
    assert all(a["arg_1"] == options for a in args)
    stops = [*options["until"], smol4.tokenizer.eos_token]  # lm-eval adds the EOS text to `until`
    ids = [smol4.tokenizer(a["arg_0"], add_special_tokens=False)["input_ids"] for a in args]
    params = SamplingParams(max_tokens=options["max_gen_toks"], temperature=0, stop=stops)
    offline = smol4.generate(ids, params, use_tqdm=False)
    assert [s["resps"][0][0] for s in samples] == [o.outputs[0].text for o in offline]
