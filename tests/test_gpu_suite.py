"""benchmarks/gpu_suite.py off the GPU: its guard (a section that fails or runs too long is recorded and the
suite goes on, the JSON rewritten after each) and its exactness sections as `--device cpu` runs them, through
the script itself, on the installed torch and transformers. A device lease is short: what fails here would
fail there before any number is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_suite  # noqa: E402


def test_a_failed_or_slow_section_is_recorded_and_the_suite_goes_on(tmp_path):
    out = tmp_path / "suite.json"
    rows: dict = {"gpu": None}
    guard = gpu_suite.Guard(out, rows)

    def fails(rows):
        raise RuntimeError("no such kernel")

    def sleeps(rows):
        time.sleep(5)

    def works(rows, value):
        rows["works"] = value

    guard.run("fails", 5, fails)
    assert json.loads(out.read_text())["errors"] == {"fails": "RuntimeError: no such kernel"}
    guard.run("sleeps", 1, sleeps)
    guard.run("works", 5, works, 42)
    written = json.loads(out.read_text())
    assert written["works"] == 42 and set(written["seconds"]) == {"fails", "sleeps", "works"}
    assert written["errors"]["sleeps"] == "TimeoutError: section sleeps ran past 1 s"
    assert written["seconds"]["sleeps"] < 3


def _suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    paths = [str(BENCHMARKS.parent), *filter(None, [os.environ.get("PYTHONPATH")])]  # vlens from this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    command = [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--device", "cpu", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_the_exactness_sections_run_on_the_cpu(tmp_path):
    """Narrow SmolLM2-shaped layers, float32: every tap of a trace, a paged generation, greedy tokens and
    chunked prefill against HF, as on the GPU (graphs off: this is the CPU), every kind of edit on the decode path
    against eager steps; vLLM's logit changes (bans, a bias, a penalty) against HF's processors; the HookedLM section's
    patching sweeps, steered generate and gradients (the CPU against itself here: the section's code, not its
    numbers); and Gemma 4 in E2B's layout, Qwen 3.5 in 0.8B's, Bamba's, mamba-130m's, Nemotron-H's, Falcon-H1's,
    DeepSeek-V3's and Llama 4 Scout's against HF; and a LLaVA, a Gemma 3, a Qwen2-VL and a Qwen3-VL given images."""
    sections = "exact,sampling,hooked,gemma4,qwen3_5,bamba,mamba,nemotron_h,falcon_h1,deepseek,llama4,images"
    done = _suite(tmp_path, "--sections", sections, "--out", "suite.json")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "suite.json").read_text())
    assert "errors" not in rows, rows["errors"]
    assert (rows["device"], rows["gpu"]) == ("cpu", None)
    assert set(rows["seconds"]) == {"exact", "sampling", "hooked", "gemma4", "qwen3_5", "bamba", "mamba", "nemotron_h",
                                    "falcon_h1", "deepseek", "llama4", "images"}
    exact = rows["exact"]
    assert exact["ok"] and exact["chunked_ok"] and exact["bf16_chunked_ok"] and exact["edits_ok"], exact
    assert exact["trace_taps"] > 500 and exact["greedy_equal"] == "3/3"
    assert rows["sampling"]["ok"] and rows["sampling"]["greedy_equal_hf"] == "5/5"  # (bans, bias, penalty: HF's)
    hooked = rows["hooked"]
    assert hooked["tokens_equal"] and hooked["get_act_patch_resid_pre_max_abs_diff"] == 0 < hooked["metric_scale"]
    assert [v for k, v in hooked.items() if k.endswith("_grad_rel_err")] == [0.0] * 3
    gemma4 = rows["gemma4"]  # (Gemma 4 in E2B's layout: every tap, a shared layer's rows through generation)
    assert gemma4["ok"] and gemma4["trace_taps"] > 150 and gemma4["greedy_equal"] == "2/2", gemma4
    # (every tap; a linear, Mamba, latent attention or NoPE layer's rows through generation; where layers keep states,
    # a chat's next turn from the state its first turn's sequence left, fewer tokens computed, HF's numbers)
    for name in ("qwen3_5", "bamba", "mamba", "nemotron_h", "falcon_h1", "deepseek", "llama4"):
        row, stateful = rows[name], name not in ("deepseek", "llama4")
        assert row["ok"] and row["trace_taps"] > 60 and row["greedy_equal"] == ("4/4" if stateful else "2/2"), row
        assert not stateful or row["next_turn"]["tokens_computed"] < row["next_turn"]["without_the_cache"], row
    # (every tap of two prompts: a LLaVA's, a Gemma 3's, whose images attend both ways, a Qwen2-VL's, its M-RoPE, a
    # Qwen3-VL's, its deepstack)
    images, families = rows["images"], ("llava", "gemma3", "qwen2_vl", "qwen3_vl")
    assert images["ok"] and all(images[name]["trace_taps"] > 100 for name in families), images
    assert all(images[name]["harvest_max_rel_err"] <= 1e-5 for name in families)  # (its image records)


def test_an_unknown_section_is_refused(capsys):
    """Before any work (in this process: the script's own argument check)."""
    with pytest.raises(SystemExit) as stopped:
        gpu_suite.main(["--device", "cpu", "--sections", "exact,latency"])
    assert stopped.value.code == 2
    assert "--sections: latency not among generate, exact, profile, harvest" in capsys.readouterr().err
