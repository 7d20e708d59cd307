"""pagedserve: an LLM serving engine built on PagedAttention."""

from pagedserve.engine import LLM, LLMEngine
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
