"""pagedserve: an LLM serving engine built on PagedAttention.

The exports load on first use, so `import pagedserve.client` (the gRPC SDK) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"

_EXPORTS = {"LLM": "pagedserve.llm", "LLMEngine": "pagedserve.engine.llm_engine",
            "SamplingParams": "pagedserve.sampling_params", "RequestOutput": "pagedserve.outputs",
            "CompletionOutput": "pagedserve.outputs", "LoRARequest": "pagedserve.lora.lora_request"}

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.llm import LLM
    from pagedserve.lora.lora_request import LoRARequest
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
