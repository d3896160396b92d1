"""Shared fixtures: the real SmolLM2 (vlens and HF side by side) and tiny random checkpoints on disk."""

from __future__ import annotations

import pytest
import torch

from vlens import LLM
from vlens.loader import resolve_model_path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64: the parity metric of the issues."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="session")
def smol_path():
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def smol(smol_path) -> LLM:
    return LLM(model=str(smol_path), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


def save_tiny(config, path) -> str:
    """Random weights for `config` (a transformers config object), saved like a real checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)
