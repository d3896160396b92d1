"""vlens: a fast LLM inference engine that returns what happens inside the model."""

from vlens.llm import LLM
from vlens.loader import load_model

__version__ = "0.1.0"
__all__ = ["LLM", "load_model", "__version__"]
