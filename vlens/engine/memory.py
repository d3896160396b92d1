"""How much memory the KV cache may take, measured the way serving engines do.

On CUDA: `gpu_memory_utilization` of the device's memory, minus what the weights and the largest
forward the engine's limits allow use at their peak — measured by running that forward once on dummy
tokens through the runner before the cache exists. On a CPU: 2 GiB, or a quarter of the free memory if
that is less.
"""

from __future__ import annotations

import os

import torch

from vlens.engine.config import EngineConfig
from vlens.engine.model_runner import ModelRunner

CPU_DEFAULT_KV_BYTES = 2 << 30


def kv_cache_bytes(runner: ModelRunner, config: EngineConfig) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    device = runner.device
    if device.type != "cuda":
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(CPU_DEFAULT_KV_BYTES, available // 4)
    peak = _peak_forward_bytes(runner, config)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * config.gpu_memory_utilization) - peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {config.gpu_memory_utilization} of {total} bytes leaves nothing for the KV "
            f"cache after the weights and a {config.max_num_batched_tokens}-token forward ({peak} bytes at peak); "
            "raise it, or lower max_num_batched_tokens"
        )
    return budget


def _peak_forward_bytes(runner: ModelRunner, config: EngineConfig) -> int:
    """Peak CUDA memory of the weights plus one forward of max_num_batched_tokens tokens, with the
    logits of max_num_seqs rows."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    tokens = min(config.max_num_batched_tokens, runner.cfg.max_position_embeddings)
    runner.profile(tokens, min(tokens, config.max_num_seqs))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return peak
