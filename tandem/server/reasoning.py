"""Reasoning parsers: a thinking model's answer split into its thinking and its reply.

Qwen3, DeepSeek-R1 and its distills, SmolLM3 and others think between ``<think>`` and
``</think>`` before they answer (vLLM's ``deepseek_r1`` and ``qwen3`` parsers; one
parser here, ``think``). Some chat templates open the tag in the prompt (the
generation prompt ends with ``<think>``), and the model's text then starts inside the
thinking; others let the model write it. A chat whose thinking was turned off in the
template (``chat_template_kwargs: {"enable_thinking": false}``) closes it in the
prompt, and the whole text is the reply.

    text          <think>Paris is in France.</think>\\n\\nParis.
    thinking      Paris is in France.
    reply         Paris.

``split`` parses a whole text; ``parts`` says how much of a growing text can go out as
thinking and as reply without being taken back (a tag cut between two steps is held
until it is whole). Tool calls and the reply's other parsing apply to the reply.

The engine's part (``plan``): a request with a thinking budget, a structured output or
a required tool call gets a ThinkingParams (sampling.py): the end of the thinking is
forced at the budget, and the constraint holds the reply only. Its prompt must open the
thinking: a template that leaves it to the model (Qwen3's) gets ``<think>\n`` appended,
as the model would write first; a template that closed it (thinking turned off) gets
neither budget nor gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

START, END = "<think>", "</think>"
# --reasoning-parser: what each name parses (vLLM's names for the same tags too).
PARSERS = ("think", "deepseek_r1", "qwen3")
CHOICES = ("auto", "none", *PARSERS)


def parser_for(name: str, chat_template: str | None) -> str | None:
    """The parser a server uses: ``auto`` takes ``think`` when the chat template
    mentions the tag, else none."""
    if name == "none":
        return None
    if name == "auto":
        return "think" if chat_template is not None and END in chat_template else None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (choose from {', '.join(CHOICES)})")
    return "think"


# OpenAI's reasoning_effort as a thinking budget in tokens (None: unbounded).
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": None}


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class Parts:
    """Where a text's thinking and reply lie: text[thinking_start:thinking_end] and
    text[reply_start:reply_end] (thinking_end == thinking_start: none yet)."""

    thinking_start: int
    thinking_end: int
    reply_start: int
    reply_end: int


class ThinkParser:
    def __init__(
        self, starts_inside: bool, decode: Callable[[list[int]], str] | None = None
    ) -> None:
        """``starts_inside``: the prompt opened the thinking (its generation prompt
        ends with ``<think>``); ``decode``: token ids to text, special tokens kept
        (to count the thinking's tokens; without it they are not counted)."""
        self.starts_inside = starts_inside
        self.decode = decode

    def parts(self, text: str, final: bool) -> Parts:
        """The thinking and the reply in ``text``; unless ``final``, what might still
        turn out to be a tag is left out of both."""
        body = len(text) - len(text.lstrip())
        if self.starts_inside:
            start = 0
        elif text[body:].startswith(START):
            start = body + len(START)
        elif not final and START.startswith(text[body:]):  # "<thi": maybe the tag
            return Parts(0, 0, 0, 0)
        else:  # no thinking: the whole text is the reply
            return Parts(0, 0, 0, len(text))
        end = text.find(END, start)
        if end < 0:  # still thinking
            stop = len(text) if final else len(text) - _held(text, END)
            return Parts(start, stop, stop, stop)
        reply = end + len(END)
        while reply < len(text) and text[reply] in "\n\r \t":
            reply += 1
        return Parts(start, end, reply, len(text))

    def split(self, text: str) -> tuple[str | None, str]:
        """(thinking, reply) of a whole answer; thinking is None when there was none."""
        parts = self.parts(text, final=True)
        thinking = text[parts.thinking_start : parts.thinking_end]
        has_thinking = self.starts_inside or parts.thinking_start > 0
        return (thinking if has_thinking else None), text[parts.reply_start : parts.reply_end]

    def thinking_tokens(self, token_ids: list[int], text: str) -> int | None:
        """How many of an answer's tokens (``token_ids``, which decode to ``text``)
        are thinking, its end tag's included: all of them while it still thinks, none
        without thinking; None without ``decode``. The end's token is found by
        decoding prefixes (a binary search: the end in a prefix stays in longer ones)."""
        parts = self.parts(text, final=True)
        if not self.starts_inside and parts.thinking_start == 0:
            return 0
        if text.find(END, parts.thinking_start) < 0:
            return len(token_ids)
        if self.decode is None:
            return None
        low, high = 1, len(token_ids)  # the shortest prefix holding the end
        while low < high:
            middle = (low + high) // 2
            if END in self.decode(token_ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return low


def starts_inside(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters) leaves the model thinking."""
    tail = prompt_tail.rstrip()
    return tail.endswith(START)


@dataclass(frozen=True)
class Plan:
    """How one chat request thinks: its prompt text, whether the answer starts inside
    the thinking, and whether the engine holds the thinking (a ThinkingParams)."""

    prompt: str
    starts_inside: bool
    gated: bool


def plan(prompt: str, budget: int | None, constrained: bool) -> Plan:
    """The thinking of a request whose rendered prompt is ``prompt``, with a thinking
    ``budget`` (or None) and a constraint on its reply (``constrained``)."""
    tail = prompt[-64:].rstrip()
    if tail.endswith(END):  # the template closed it: no thinking to hold
        return Plan(prompt, False, False)
    inside = starts_inside(tail)
    gated = budget is not None or constrained
    if gated and not inside:  # what the model would write first
        return Plan(prompt + START + "\n", True, True)
    return Plan(prompt, inside, gated)
