"""tandem: an LLM inference engine you can read."""

from __future__ import annotations

from tandem.llm import LLM
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
