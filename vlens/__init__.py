"""vlens: a fast LLM inference engine that returns what happens inside the model."""

from vlens.engine.config import EngineConfig
from vlens.harvest import ActivationDataset, HarvestConfig, harvest  # the function shadows its subpackage
from vlens.interventions import Ablate, Patch, Steer
from vlens.llm import LLM
from vlens.loader import load_model
from vlens.outputs import CompletionOutput, Logprob, RequestOutput
from vlens.sampling_params import Capture, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "EngineConfig",
    "SamplingParams",
    "Capture",
    "Steer",
    "Ablate",
    "Patch",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "load_model",
    "harvest",
    "HarvestConfig",
    "ActivationDataset",
    "__version__",
]
