"""``tandem tune-layer-skip``: the layers a self-speculating draft (method layer_skip)
should skip, chosen on the target's own answers (tandem/train/layer_skip_tuning.py)."""

from __future__ import annotations

import argparse

HELP = "choose the layers a self-speculating draft skips (speculative method layer_skip)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="folder, GGUF file or catalog name")
    parser.add_argument("--prompts", type=int, default=3, metavar="N",
                        help="calibration prompts answered by the target (at most 6)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=64, metavar="N", help="per answer")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="rows to print")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> None:
    import json

    from tandem.errors import InvalidParameterError
    from tandem.llm import LLM
    from tandem.train.layer_skip_tuning import PROMPTS, tune

    if not 1 <= args.prompts <= len(PROMPTS) or args.tokens < 8:
        raise InvalidParameterError("--prompts", f"in 1-{len(PROMPTS)}, with --tokens >= 8")
    llm = LLM(args.model)
    if not hasattr(llm.engine.executor.runner.model, "skipped_layers"):
        raise InvalidParameterError("--model", "layer skipping needs a Llama-family model")
    candidates = tune(llm, args.prompts, args.tokens)
    best = candidates[0]
    if args.json:
        print(json.dumps([
            {"skip_layers": c.label, "agreement": c.agreement, "cost": c.cost, "k": c.k,
             "estimated_speedup": c.speedup}
            for c in candidates
        ]))  # fmt: skip
        return
    print(
        f"{'skip layers':<16}{'agreement':>10}{'cost/guess':>11}{'best k':>7}{'est. speedup':>13}"
    )
    for c in candidates[: args.top]:
        print(f"{c.label:<16}{c.agreement:>10.1%}{c.cost:>11.2f}{c.k:>7}{c.speedup:>12.2f}x")
    if best.speedup <= 1.0:
        print("no set of skipped layers is estimated to pay on this model")
    print(
        f"use: --speculative-method layer_skip --speculative-skip-layers {best.label} "
        f"--num-speculative-tokens {best.k}"
    )
