"""vlens: a fast LLM inference engine that returns what happens inside the model."""

from vlens.llm import LLM
from vlens.loader import load_model
from vlens.outputs import CompletionOutput, Logprob, RequestOutput
from vlens.sampling_params import Capture, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "Capture",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "load_model",
    "__version__",
]
