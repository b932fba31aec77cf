"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from tandem.errors import TandemError


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local Hugging Face model folder")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")


def _generate(args: argparse.Namespace) -> None:
    import torch

    from tandem.models.loader import load_model
    from tandem.runner.static_batch import stream_with_cache

    if args.max_tokens < 1:
        raise TandemError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise TandemError("--temperature must be >= 0")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise TandemError(f"{args.model} has no tokenizer.json, so text cannot be generated")
    if args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    context = loaded.config.max_position_embeddings
    if len(prompt_ids) + args.max_tokens > context:
        raise TandemError(
            f"prompt ({len(prompt_ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the "
            f"model's context of {context} tokens"
        )
    eos = set(loaded.eos_token_ids)
    generated: list[int] = []
    printed = ""
    start = time.perf_counter()
    token_times = []
    for tokens in stream_with_cache(
        loaded,
        [prompt_ids],
        args.max_tokens,
        block_size=args.block_size,
        temperature=args.temperature,
        seed=args.seed,
    ):
        token_times.append(time.perf_counter())
        token = int(tokens[0])
        if token in eos:
            break
        generated.append(token)
        text = tokenizer.decode(generated)
        # A multi-byte character split across tokens decodes to U+FFFD until its
        # last byte arrives; hold it back rather than print a replacement mark.
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    ttft = token_times[0] - start
    gaps = [b - a for a, b in itertools.pairwise(token_times)]
    tpot = sum(gaps) / len(gaps) if gaps else 0.0
    total = token_times[-1] - start
    print(
        f"[{len(prompt_ids)} prompt tokens, {len(token_times)} generated] "
        f"TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.1f} ms, "
        f"{len(token_times) / total:.1f} tokens/s",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="stream a completion for one prompt")
    _add_model_options(generate)
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template"
    )
    generate.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    generate.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except TandemError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
