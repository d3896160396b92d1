"""vlens: a fast LLM inference engine that returns what happens inside the model."""

from vlens import viz  # vlens.viz.logit_lens(output) and the other views
from vlens.activation_cache import ActivationCache
from vlens.beam_search import BeamSearchParams
from vlens.capture import Ablate, Capture, Clamp, Patch, Positions, Steer, TunedLens
from vlens.encode import PoolingParams
from vlens.engine.config import EngineConfig
from vlens.engine.lora import LoRARequest
from vlens.harvest import ActivationDataset, HarvestConfig, harvest  # the function shadows its subpackage
from vlens.hooked import HookedLM
from vlens.llm import LLM
from vlens.loader import load_model
from vlens.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingRequestOutput,
    RequestDelta,
    RequestOutput,
    ScoringRequestOutput,
)
from vlens.sae import SAE
from vlens.sampling_params import SamplingParams, StructuredOutputsParams
from vlens.version import __version__

__all__ = [
    "LLM",
    "HookedLM",
    "ActivationCache",
    "SamplingParams",
    "PoolingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "Capture",
    "Positions",
    "EngineConfig",
    "LoRARequest",
    "HarvestConfig",
    "Steer",
    "Ablate",
    "Patch",
    "Clamp",
    "SAE",
    "TunedLens",
    "RequestOutput",
    "RequestDelta",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "PoolingRequestOutput",
    "Logprob",
    "load_model",
    "harvest",
    "ActivationDataset",
    "viz",
    "__version__",
]
