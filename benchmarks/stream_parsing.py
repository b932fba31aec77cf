"""What reading a streamed answer costs a step: the reasoning parser and the tool-call
formats re-read the growing reply each step (server/reasoning.py, server/tool_formats/).
One answer (thinking, then a sentence, then a call with long arguments) is streamed a
token a step through the server's ChoiceStream with nothing to read, with thinking,
with tools (a format each), and with both; each step's cost is set beside the model's
time per output token measured in the same run (greedy decode, batch 1).

    python -m benchmarks.stream_parsing [--model smollm2-135m-instruct] [--tokens 1000 4000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import machine
from tandem import LLM, SamplingParams
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.server.reasoning import ThinkParser
from tandem.server.responses import ChoiceStream
from tandem.server.tool_calls import ToolCalling

TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
    "required": ["path", "text"]}}}  # fmt: skip


WORDS = "the plan is to write the summary into a file and then check it again"


def answer(tokens: int, style: str) -> str:
    """An answer of about ``tokens`` tokens: a third thinking, a sentence, a call whose
    arguments hold the rest."""
    words = WORDS.split()

    def text(count: int) -> str:
        return " ".join(words[i % len(words)] for i in range(count))

    thinking = f"<think>\n{text(tokens // 3)}\n</think>\n\n"
    body = text(tokens * 2 // 3)
    if style == "qwen3_xml":
        call = (f"<tool_call>\n<function=write_file>\n<parameter=path>\nnotes.md\n"
                f"</parameter>\n<parameter=text>\n{body}\n</parameter>\n</function>\n"
                "</tool_call>")  # fmt: skip
    else:
        arguments = json.dumps({"path": "notes.md", "text": body})
        call = f'<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>'
    return f"{thinking}Writing it now.\n{call}"


def per_step_us(pieces: list[str], tools: ToolCalling | None, thinking: bool) -> float:
    """Microseconds a step to update the stream and build its chunk."""
    state = ChoiceStream("r", "m", 0, ["e"], 1, chat=True, want_logprobs=False, tools=tools,
                         reasoning=ThinkParser(False) if thinking else None)  # fmt: skip
    start = time.perf_counter()
    for index, piece in enumerate(pieces):
        finish = "stop" if index == len(pieces) - 1 else None
        output = RequestOutput("e", None, [1], [CompletionOutput(0, piece, [0], finish)],
                               finish is not None)  # fmt: skip
        for choice, delta in state.update(output):
            state.chunk(choice, delta)
    return (time.perf_counter() - start) / len(pieces) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(machine())
    llm = LLM(args.model)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    tpots = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = llm.generate("Write a long story.", params, use_tqdm=False)[0]
        tpots.append((time.perf_counter() - start) / len(out.outputs[0].token_ids) * 1e3)
    tpot = statistics.median(tpots)
    print(f"TPOT, {args.model}, batch 1, 256 tokens, median of {args.repeats}: {tpot:.2f} ms")
    print("| answer tokens | reads | us/step | + vs nothing read | of TPOT |")
    print("|---|---|---|---|---|")
    for count in args.tokens:
        for style in ("hermes", "qwen3_xml"):
            ids = tokenizer.encode(answer(count, style), False)
            pieces = [tokenizer.decode(ids[i : i + 1], False) for i in range(len(ids))]
            cases = {
                "nothing": (None, False),
                "thinking": (None, True),
                f"tools ({style})": (ToolCalling.of([TOOL], "auto", style), False),
                f"both ({style})": (ToolCalling.of([TOOL], "auto", style), True),
            }
            base = 0.0
            for name, (tools, thinking) in cases.items():
                us = statistics.median(
                    per_step_us(pieces, tools, thinking) for _ in range(args.repeats)
                )
                if name == "nothing":
                    base = us
                extra = us - base
                print(f"| {len(ids)} | {name} | {us:.1f} | {extra:+.1f} | "
                      f"{extra / (tpot * 1e3) * 100:.2f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
