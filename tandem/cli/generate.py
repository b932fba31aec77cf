"""``tandem generate``: stream one completion to the terminal, then TTFT, TPOT and
tokens/s on stderr."""

from __future__ import annotations

import argparse
import sys

from tandem.cli.engine_args import (
    add_engine_arguments,
    apply_threads,
    engine_options,
    model_or_default,
)

HELP = "stream a completion for one prompt"


def backslash_escapes(value: str) -> str:
    """``\\n``, ``\\t``, ``\\uXXXX`` ... as the characters they name (a shell passes
    ``"\\n"`` as two characters); other text, non-ASCII included, is kept as it is."""
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    add_sampling_arguments(parser, max_tokens=64)
    parser.add_argument(
        "--stop", action="append", default=None, type=backslash_escapes, metavar="TEXT",
        help="stop string; backslash escapes are read, so '\\n\\n' is two newlines (repeat)",
    )  # fmt: skip
    parser.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the steps")
    add_engine_arguments(parser)


# What the command line samples with when the model recommends nothing (its
# generation_config sets no sampling field: a GGUF file, say): SmolLM2's authors'
# advice for its instruct models. vLLM's API default, temperature 1.0 on the whole
# vocabulary, makes a 135M model ramble; greedy decoding tends to loop. The Python and
# HTTP APIs keep vLLM's defaults.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    sampling = parser.add_argument_group(
        "sampling",
        "flags left out take the model's generation_config.json values; a model that "
        "recommends none gets temperature 0.2, top-p 0.9",
    )
    sampling.add_argument(
        "--max-tokens", type=int, default=max_tokens, metavar="N",
        help=f"tokens to generate (default: {max_tokens})",
    )  # fmt: skip
    sampling.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    sampling.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass")
    sampling.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest")
    sampling.add_argument("--repetition-penalty", type=float, metavar="R", help="> 1 penalises")
    sampling.add_argument("--sampling-seed", type=int, metavar="N", help="per-request seed")


def sampling_params(llm, args: argparse.Namespace, **fields):
    """The flags given, over the model's recommendations, over CLI_SAMPLING_DEFAULTS."""
    chosen = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "repetition_penalty": args.repetition_penalty,
    }
    base = {} if model_recommends_sampling(llm) else dict(CLI_SAMPLING_DEFAULTS)
    base.update({name: value for name, value in chosen.items() if value is not None})
    return llm.get_default_sampling_params(
        **base, max_tokens=args.max_tokens, seed=args.sampling_seed, **fields
    )


def model_recommends_sampling(llm) -> bool:
    from tandem.sampling import model_sampling_defaults

    return bool(model_sampling_defaults(llm.engine.model_info.generation_config))


def print_stats(final, num_tokens: int) -> None:
    """TTFT, TPOT and tokens/s of a streamed answer, on stderr."""
    completion = final.outputs[0]
    m = completion.metrics
    elapsed = (m.token_times[-1] if m.token_times else m.arrival_time) - m.arrival_time
    ttft = f"{m.ttft * 1e3:.1f} ms" if m.ttft is not None else "n/a"
    tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
    rate = f"{num_tokens / elapsed:.1f} tokens/s" if elapsed > 0 else "n/a"
    print(
        f"[{len(final.prompt_token_ids)} prompt tokens, {num_tokens} generated, "
        f"finish: {completion.finish_reason}] TTFT {ttft}, TPOT {tpot}, {rate}",
        file=sys.stderr,
    )


def stream_to_stdout(llm, prompt, params, request_id: str):
    """Print the completion as it comes; returns (the final output, the text, tokens)."""
    num_tokens, final, text = 0, None, []
    for output in llm.stream(prompt, params, request_id=request_id):
        completion = output.outputs[0]
        sys.stdout.write(completion.text)
        sys.stdout.flush()
        text.append(completion.text)
        num_tokens += len(completion.token_ids)
        final = output
    sys.stdout.write("\n")
    return final, "".join(text), num_tokens


def run(args: argparse.Namespace) -> None:
    from tandem import LLM

    apply_threads(args)
    llm = LLM(model_or_default(args), **engine_options(args))
    params = sampling_params(llm, args, stop=args.stop, ignore_eos=args.ignore_eos)
    prompt = args.prompt
    if args.chat:
        conversation = [{"role": "user", "content": args.prompt}]
        prompt = {"prompt_token_ids": llm.get_tokenizer().encode_chat(conversation)}
    if args.trace:
        llm.start_trace()
    final, _, num_tokens = stream_to_stdout(llm, prompt, params, "cli")
    if args.trace:
        llm.stop_trace(args.trace)
    print_stats(final, num_tokens)
