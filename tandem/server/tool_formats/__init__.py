"""The tool-call formats tandem reads and writes, one descriptor each (base.py says
what a descriptor is). ``--tool-call-parser`` names one (or vLLM's name for it);
``auto``, the default, picks the one whose markers the chat template contains, in
this order (the most specific first), and hermes when none matches."""

from __future__ import annotations

from tandem.server.tool_formats.base import ToolFormat
from tandem.server.tool_formats.deepseek_v3 import DeepSeekV3
from tandem.server.tool_formats.harmony import Harmony
from tandem.server.tool_formats.hermes import Hermes
from tandem.server.tool_formats.llama3_json import Llama3Json
from tandem.server.tool_formats.mistral import Mistral
from tandem.server.tool_formats.pythonic import Pythonic
from tandem.server.tool_formats.qwen3_xml import Qwen3Xml

FORMATS: tuple[ToolFormat, ...] = (
    Harmony(), Qwen3Xml(), Mistral(), DeepSeekV3(), Pythonic(), Hermes(), Llama3Json(),
)  # fmt: skip
DEFAULT = "hermes"
_BY_NAME = {name: f for f in FORMATS for name in (f.name, *f.aliases)}
CHOICES = ("auto", *_BY_NAME)


def tool_format(name: str, chat_template: str | None) -> ToolFormat:
    """The format a server reads tool calls in: ``name``, or with ``auto`` the one the
    chat template writes. Raises ValueError for an unknown name."""
    if name == "auto":
        found = next(
            (f for f in FORMATS if chat_template and all(m in chat_template for m in f.markers)),
            _BY_NAME[DEFAULT],
        )
    elif name in _BY_NAME:
        found = _BY_NAME[name]
    else:
        raise ValueError(f"unknown tool-call parser {name!r} (choose from {', '.join(CHOICES)})")
    return found.fitted(chat_template)
