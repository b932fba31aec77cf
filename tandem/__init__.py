"""tandem: an LLM inference engine you can read."""

from __future__ import annotations

__version__ = "0.1.0"
