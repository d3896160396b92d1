"""Every setting of an engine, declared once: `LLM(**kwargs)`, the flags of `vlens serve`, `generate` and
`trace`, and their validation all come from this dataclass (see vlens.settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlens.attention import BACKENDS
from vlens.generation_config import source_problem
from vlens.loader import DEFAULT_MODEL, device_problem, dtype_problem
from vlens.reasoning import PARSERS as REASONING_PARSERS
from vlens.settings import from_kwargs, setting, validate

MODEL_HELP = f"HF checkpoint directory, .gguf file or hub id (default: the embedded {DEFAULT_MODEL})"
HF_OVERRIDES_HELP = (
    "names set on the checkpoint's HF config before vlens reads it (vLLM's), a JSON object: {\"is_matryoshka\": "
    "true} for an embedding model trained to be cut short (PoolingParams.dimensions), {\"architectures\": "
    "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
    "\"is_original_qwen3_reranker\": true} to read a causal LM as the classifier its tokens make (vlens.classify)"
)
REVISION_HELP = "branch, tag or commit of a hub model, e.g. a training checkpoint (Pythia's step1000)"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = setting(None, MODEL_HELP)
    revision: str | None = setting(None, REVISION_HELP)
    hf_overrides: dict[str, Any] | None = setting(None, HF_OVERRIDES_HELP)
    dtype: str = setting(
        "auto", "auto (bfloat16 on CUDA, else float32), float32, float16 or bfloat16", check=dtype_problem
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N", check=device_problem)
    max_num_seqs: int = setting(256, "most sequences in one batch", minimum=1)
    max_num_batched_tokens: int = setting(4096, "most tokens per step (and per trace forward)", minimum=1)
    max_model_len: int | None = setting(None, "longest sequence, prompt plus output (default: the model's)", minimum=1)
    kv_cache_memory: int | None = setting(
        None, "bytes for the KV cache (default on CUDA: gpu_memory_utilization of the device less the weights and the largest forward; on CPU: 2 GiB, or a quarter of free memory if less)", minimum=1
    )
    block_size: int = setting(16, "tokens per KV-cache block", minimum=1)
    latent_kv_cache: bool = setting(
        False, "multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, ...): cache each token's latent "
        "and rotating key part, not every head's keys and values (5x less memory a token with V2-Lite's 16 heads, 43x "
        "with V3's 128; the queries and outputs "
        "go through the latent's projections instead: float32 within 1e-5 of HF, bfloat16 not bit for bit; edits of "
        "attn.hook_k and attn.hook_v refused)",
    )
    enable_lora: bool = setting(False, "serve LoRA adapters beside the base model: a request names one "
                                "(LLM.generate's lora_request; vlens.engine.lora)")  # fmt: skip
    max_loras: int = setting(1, "LoRA adapters held at once (a request under another waits for a slot)", minimum=1)
    max_lora_rank: int = setting(16, "the largest rank of a LoRA adapter", minimum=1)
    enable_capture: bool = setting(True, "allow requests to capture activations", flag="--no-capture", invert=True)
    enable_prefix_caching: bool = setting(
        True, "reuse the KV of identical prompt prefixes", flag="--no-prefix-caching", invert=True
    )
    seed: int = setting(0, "seed of the samples of requests that give none")
    generation_config: str = setting(
        "auto", "sampling defaults of requests that leave them out: auto (the model's generation_config.json: "
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm (none: SamplingParams' own) or "
        "a folder holding such a file", check=source_problem,
    )  # fmt: skip
    reasoning_parser: str | None = setting(
        None, "a reasoning model's (vLLM's): deepseek_r1, qwen3, deepseek_v3 or openai_gptoss; a structured request "
        "thinks first, its structure holding the text only after the thinking's end (</think>, gpt-oss's final "
        "channel; at once where the prompt ends its thinking)",
        choices=tuple(REASONING_PARSERS),
    )  # fmt: skip
    scheduling_policy: str = setting(
        "fcfs", "fcfs (first come, first served) or priority (vLLM's: a request's `priority`, lower first, then "
        "arrival, orders the waiting queue, and when the KV cache runs out the running sequence that comes last by it "
        "is preempted)", choices=("fcfs", "priority"),
    )
    attention_backend: str = setting(
        "auto", "auto (the fastest exact one here, see vlens.attention.choose), sdpa, varlen, flex or flashinfer",
        choices=BACKENDS,
    )
    enforce_eager: bool = setting(False, "no compiled kernels and no CUDA graphs: every step runs eagerly")
    compile_decode: bool = setting(
        False, "on the CPU, run decode steps through torch.compile (inductor): one compile per batch bucket, page "
        "bucket and set of taps, at its first step (seconds; cached on disk), then the fused forward without "
        "per-operator overhead. On CUDA decode steps replay CUDA graphs instead",
    )
    async_scheduling: bool = setting(
        True, "queue the next decode step while the device runs this one (with CUDA graphs; outputs unchanged)",
        flag="--no-async-scheduling", invert=True,
    )
    tensor_parallel_size: int = setting(
        1, "ranks the model is split across (heads, MLP columns, vocabulary): one process and one device each",
        minimum=1,
    )
    distributed_executor_backend: str = setting(
        "mp", "where ranks 1.. of tensor parallelism run: mp (processes on this machine) or ray (Ray actors, "
        "one device each, on any machine of the cluster; pip install 'vlens[ray]')", choices=("mp", "ray"),
    )
    gpu_memory_utilization: float = setting(
        0.9, "share of the GPU's memory the engine may use: weights, the profiled forward, then the KV cache",
        check=lambda v: None if 0 < v <= 1 else f"{v!r} is not a fraction in (0, 1]",
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.compile_decode and self.enforce_eager:
            raise ValueError("compile_decode: True compiles the decode step, which enforce_eager=True forbids")
        if self.compile_decode and self.tensor_parallel_size > 1:
            raise ValueError("compile_decode: True runs in one process (tensor_parallel_size 1), not across ranks")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        return from_kwargs(cls, kwargs)
