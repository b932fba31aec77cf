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

gpt-oss thinks in harmony's ``analysis`` channel (tool_formats/harmony.py; vLLM's
``openai_gptoss`` parser): ``HarmonyParser``, the same parts with the analysis
message's header and ``<|end|>`` as the tags, the reply a final message's body (or
the header of a call, for the harmony tool format to read).

    text          <|channel|>analysis<|message|>Paris is in France.<|end|>
                  <|start|>assistant<|channel|>final<|message|>Paris.
    thinking      Paris is in France.
    reply         Paris.

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

from tandem.server.tool_formats import harmony

START, END = "<think>", "</think>"
# --reasoning-parser: what each name parses (vLLM's names for the same tags too).
PARSERS = {"think": "think", "deepseek_r1": "think", "qwen3": "think",
           "harmony": "harmony", "openai_gptoss": "harmony"}  # fmt: skip
CHOICES = ("auto", "none", *PARSERS)


def parser_for(name: str, chat_template: str | None) -> str | None:
    """The parser a server uses (``think`` or ``harmony``): ``auto`` takes harmony
    when the chat template writes its analysis channel, ``think`` when it mentions
    the tag, else none."""
    if name == "none":
        return None
    if name == "auto":
        if chat_template is not None and HarmonyParser.start in chat_template:
            return "harmony"
        return "think" if chat_template is not None and END in chat_template else None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (choose from {', '.join(CHOICES)})")
    return PARSERS[name]


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
    # The tags around the thinking, and what a prompt gets appended to open it.
    start: str = START
    end: str = END
    opener: str = START + "\n"
    # Whether the tags are special tokens (the text must keep them to be parsed).
    special: bool = False

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
        elif text[body:].startswith(self.start):
            start = body + len(self.start)
        elif not final and self.start.startswith(text[body:]):  # "<thi": maybe the tag
            return Parts(0, 0, 0, 0)
        else:  # no thinking: the whole text is the reply
            return Parts(0, 0, *self.reply(text, 0, final))
        end = text.find(self.end, start)
        if end < 0:  # still thinking
            stop = len(text) if final else len(text) - _held(text, self.end)
            return Parts(start, stop, stop, stop)
        return Parts(start, end, *self.reply(text, end + len(self.end), final))

    def reply(self, text: str, at: int, final: bool) -> tuple[int, int]:
        """Where the reply lies in ``text`` from ``at``: after the thinking, past the
        blank lines the model writes first; without any thinking (``at`` 0), the whole
        text as it is."""
        while 0 < at < len(text) and text[at] in "\n\r \t":
            at += 1
        return at, len(text)

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
        if text.find(self.end, parts.thinking_start) < 0:
            return len(token_ids)
        if self.decode is None:
            return None
        low, high = 1, len(token_ids)  # the shortest prefix holding the end
        while low < high:
            middle = (low + high) // 2
            if self.end in self.decode(token_ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return low


class HarmonyParser(ThinkParser):
    """gpt-oss's analysis channel (the module's docstring). The generation prompt ends
    with ``<|start|>assistant``, so the answer's first header has no ``<|start|>``."""

    start = f"{harmony.CHANNEL}analysis{harmony.MESSAGE}"
    end = harmony.END
    opener = start
    special = True

    def reply(self, text: str, at: int, final: bool) -> tuple[int, int]:
        """A final message's (or a preamble's) body, up to its end; a call's header
        on, for the harmony tool format (and what follows a body, once a call does);
        text with no header (a structured reply held right after the thinking) as it
        is; nothing while a header is still being written."""
        header = harmony.HEADER.match(text, at)
        if header is None:
            if harmony.opens_header(text, at, final):
                return at, at
            return at, harmony.boundary(text, at, final)
        if harmony.RECIPIENT.search(header.group("header")):
            return at, len(text)
        body = header.end()
        stop = harmony.boundary(text, body, final)
        if harmony.RECIPIENT.search(text, stop):  # a call follows the preamble
            return body, len(text)
        return body, stop


PARSER_CLASSES: dict[str, type[ThinkParser]] = {"think": ThinkParser, "harmony": HarmonyParser}


def starts_inside(prompt_tail: str, parser: type[ThinkParser] = ThinkParser) -> bool:
    """Whether a rendered prompt (its last characters) leaves the model thinking."""
    tail = prompt_tail.rstrip()
    return tail.endswith(parser.start.rstrip())


@dataclass(frozen=True)
class Plan:
    """How one chat request thinks: its prompt text, whether the answer starts inside
    the thinking, and whether the engine holds the thinking (a ThinkingParams)."""

    prompt: str
    starts_inside: bool
    gated: bool


def plan(
    prompt: str, budget: int | None, constrained: bool, parser: type[ThinkParser] = ThinkParser
) -> Plan:
    """The thinking of a request whose rendered prompt is ``prompt``, with a thinking
    ``budget`` (or None) and a constraint on its reply (``constrained``), in the tags
    of ``parser``."""
    tail = prompt[-64:].rstrip()
    if tail.endswith(parser.end):  # the template closed it: no thinking to hold
        return Plan(prompt, False, False)
    inside = starts_inside(tail, parser)
    gated = budget is not None or constrained
    if gated and not inside:  # what the model would write first
        return Plan(prompt + parser.opener, True, True)
    return Plan(prompt, inside, gated)
