"""``tandem generate``: stream one completion to the terminal, then TTFT, TPOT and
tokens/s on stderr."""

from __future__ import annotations

import argparse
import sys

from tandem.cli.engine_args import add_engine_arguments, apply_threads, engine_options

HELP = "stream a completion for one prompt"


def backslash_escapes(value: str) -> str:
    """``\\n``, ``\\t``, ``\\uXXXX`` ... as the characters they name (a shell passes
    ``"\\n"`` as two characters); other text, non-ASCII included, is kept as it is."""
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    sampling = parser.add_argument_group(
        "sampling", "flags left out take the model's generation_config.json values"
    )
    sampling.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens to generate (default: 64)"
    )
    sampling.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    sampling.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass")
    sampling.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest")
    sampling.add_argument("--repetition-penalty", type=float, metavar="R", help="> 1 penalises")
    sampling.add_argument("--sampling-seed", type=int, metavar="N", help="per-request seed")
    sampling.add_argument(
        "--stop", action="append", default=None, type=backslash_escapes, metavar="TEXT",
        help="stop string; backslash escapes are read, so '\\n\\n' is two newlines (repeat)",
    )  # fmt: skip
    sampling.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the steps")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> None:
    from tandem import LLM

    apply_threads(args)
    llm = LLM(args.model, **engine_options(args))
    chosen = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "repetition_penalty": args.repetition_penalty,
    }
    params = llm.get_default_sampling_params(
        **{name: value for name, value in chosen.items() if value is not None},
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    prompt = args.prompt
    if args.chat:
        conversation = [{"role": "user", "content": args.prompt}]
        prompt = {"prompt_token_ids": llm.get_tokenizer().encode_chat(conversation)}
    if args.trace:
        llm.start_trace()
    num_tokens = 0
    final = None
    for output in llm.stream(prompt, params, request_id="cli"):
        completion = output.outputs[0]
        sys.stdout.write(completion.text)
        sys.stdout.flush()
        num_tokens += len(completion.token_ids)
        final = output
    sys.stdout.write("\n")
    if args.trace:
        llm.stop_trace(args.trace)
    completion = final.outputs[0]
    m = completion.metrics
    elapsed = m.token_times[-1] - m.arrival_time
    tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
    print(
        f"[{len(final.prompt_token_ids)} prompt tokens, {num_tokens} generated, "
        f"finish: {completion.finish_reason}] TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}, "
        f"{num_tokens / elapsed:.1f} tokens/s",
        file=sys.stderr,
    )
