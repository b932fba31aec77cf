"""``tandem chat``: talk to a model in the terminal. With a message (or text on stdin
when it is not a terminal), one answer; otherwise an interactive chat: the history is
kept and rendered with the model's chat template, each answer streams as it is
generated, then TTFT and tokens/s on stderr. ``/reset`` forgets the conversation,
``/exit`` (or Ctrl-D) leaves."""

from __future__ import annotations

import argparse
import contextlib
import sys

from tandem.cli.engine_args import (
    add_engine_arguments,
    apply_threads,
    engine_options,
    model_or_default,
)
from tandem.cli.generate import (
    add_sampling_arguments,
    print_stats,
    sampling_params,
    stream_to_stdout,
)
from tandem.errors import TandemError

HELP = "chat with a model in the terminal (one answer when given a message)"
PROMPT = "> "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("message", nargs="?", help="answer this and exit (default: interactive)")
    parser.add_argument("--system", metavar="TEXT", help="a system message first")
    add_sampling_arguments(parser, max_tokens=512)
    add_engine_arguments(parser)


class Conversation:
    """The messages so far, and one turn: render, stream the answer, keep it."""

    def __init__(self, llm, params, system: str | None) -> None:
        self.llm, self.params, self.system = llm, params, system
        self.messages: list[dict[str, str]] = []
        self.turns = 0
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def answer(self, text: str) -> None:
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.llm.get_tokenizer().encode_chat(messages, add_generation_prompt=True)
        self.turns += 1
        final, reply, num_tokens = stream_to_stdout(
            self.llm, {"prompt_token_ids": ids}, self.params, f"chat-{self.turns}"
        )
        print_stats(final, num_tokens)
        self.messages = [*messages, {"role": "assistant", "content": reply}]


def run(args: argparse.Namespace) -> None:
    from tandem import LLM

    apply_threads(args)
    llm = LLM(model_or_default(args), **engine_options(args))
    if llm.get_tokenizer() is None:
        raise TandemError("this model has no tokenizer to chat with")
    conversation = Conversation(llm, sampling_params(llm, args), args.system)
    if args.message is not None or not sys.stdin.isatty():
        message = args.message if args.message is not None else sys.stdin.read()
        conversation.answer(message.strip())
        return
    interactive(conversation)


def interactive(conversation: Conversation) -> None:
    with contextlib.suppress(ImportError):  # (not on every platform)
        import readline  # noqa: F401  line editing and history for input()
    print("tandem chat: /reset forgets the conversation, /exit leaves", file=sys.stderr)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:  # a fresh line, as shells do
            print(file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return
        if text == "/reset":
            conversation.reset()
            print("(conversation forgotten)", file=sys.stderr)
            continue
        try:
            conversation.answer(text)
        except KeyboardInterrupt:  # stop this answer, keep the chat
            print("\n(answer interrupted)", file=sys.stderr)
        except TandemError as exc:  # e.g. the conversation outgrew the context
            print(f"tandem: {exc} (/reset starts over)", file=sys.stderr)
