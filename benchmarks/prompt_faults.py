"""What a prompt pays the kernel for its temporaries (tandem/host_memory.py): prompts of
one length back to back, and prompts and decodes mixed, each timed with the process's
minor page faults and system time beside it.

``back to back``: ``--prompts`` requests of ``--prompt-len`` random token ids and one
new token each, one after another in one process (after one of 16 tokens to warm up):
seconds, faults and system seconds per prompt. ``mixed``: ``--requests`` requests of
256-1,024 random prompt tokens and 32 new tokens each, given to ``LLM.generate`` at
once, so that steps mix prompt chunks and decodes: seconds, the median time to first
token, faults and system seconds of the whole run (``--requests 0``: none)::

    python -m benchmarks.prompt_faults --model /tmp/tandem-models/llama-3.2-1b-q4_0.gguf
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

from benchmarks.common import machine


def timed(run) -> tuple[float, int, float, object]:
    """(seconds, minor faults, system seconds, result) of ``run()``."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    result = run()
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return seconds, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    args = parser.parse_args()
    if min(args.prompt_len, args.prompts, args.requests) < 0 or args.prompt_len == 0:
        parser.error("--prompt-len must be positive, --prompts and --requests not negative")
    from tandem import LLM, SamplingParams

    llm = LLM(model=args.model)
    vocab = llm.engine.model_info.vocab_size
    rng = random.Random(0)

    def prompt(length: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt(16), one, use_tqdm=False)
    print(f"# {machine()}\n# model {args.model}")
    print("| run | s | median TTFT s | minor faults | system s |\n|---|---|---|---|---|")
    for i in range(args.prompts):
        request = prompt(args.prompt_len)
        seconds, faults, system, _ = timed(
            lambda request=request: llm.generate(request, one, use_tqdm=False)
        )
        print(f"| prompt {i + 1} of {args.prompt_len} tokens | {seconds:.3f} | | {faults} "
              f"| {system:.2f} |", flush=True)  # fmt: skip
    if args.requests == 0:  # prompts back to back only
        return
    requests = [prompt(rng.randint(256, 1024)) for _ in range(args.requests)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    seconds, faults, system, outputs = timed(lambda: llm.generate(requests, params, use_tqdm=False))
    ttft = statistics.median(o.metrics.ttft for o in outputs)
    print(f"| {args.requests} requests mixed | {seconds:.2f} | {ttft:.2f} | {faults} "
          f"| {system:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
