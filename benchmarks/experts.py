"""A mixture of experts' decode step against the experts it reads.

Each decode step of a mixture reads, of its expert weights, only the experts its
tokens picked: for B tokens each picking k of E, E x (1 - (1 - k/E)^B) a layer on
average (tandem/plan/cost.py's expected_experts), so a step's weight reads, and its
time, grow with the batch until every expert is read. Per batch size: B requests of
a 64-token prompt of random ids decode 17 tokens together; the step trace gives each
decode step's duration and the distinct experts its layers read (the mean over
layers), the medians over the decode steps in which all B decoded. Beside them:
the expected count, the weight bytes such a step reads (the file's non-expert
matrices plus that share of its expert stacks) and the rate that makes.

A random-weight file routes every token to nearly the same experts (the token
states of a deep random network collapse towards one direction), which no trained
model does; with ``--routing uniform`` (the default) each token's router logits are
drawn at random instead (a forward hook on each router), so the experts read follow
the expectation and the step times show what reading them costs; ``--routing file``
keeps the file's own::

    python -m benchmarks.experts --model /tmp/tandem-models/qwen3-30b-a3b-q4_0.gguf \\
        --batches 1 2 4 8 16

(``python -m benchmarks.scale files --shapes qwen3-30b-a3b`` writes that file.)
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.common import machine

NEW_TOKENS = 17
PROMPT = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a mixture's GGUF file")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--routing", choices=["uniform", "file"], default="uniform")
    args = parser.parse_args()

    import torch

    from tandem import LLM, SamplingParams
    from tandem.models.gguf_file import GGUFFile
    from tandem.models.moe import SparseMoE
    from tandem.plan.cost import expected_experts
    from tandem.trace.recorder import StepTracer

    file = GGUFFile(args.model)
    arch = file.fields["general.architecture"]
    experts, used = file.fields[f"{arch}.expert_count"], file.fields[f"{arch}.expert_used_count"]
    stacks = sum(t.nbytes for t in file.tensors if "_exps." in t.name)
    names = {t.name for t in file.tensors}
    head_is_embedding = "output.weight" not in names  # (else the embedding: a row a token)
    other = sum(
        t.nbytes for t in file.tensors
        if "_exps." not in t.name and (t.name != "token_embd.weight" or head_is_embedding)
    )  # fmt: skip
    length = PROMPT + NEW_TOKENS + 8
    llm = LLM(str(args.model), max_model_len=length, max_num_seqs=max(args.batches))
    vocab = llm.engine.model_info.vocab_size
    generator = torch.Generator().manual_seed(0)
    if args.routing == "uniform":
        routing = torch.Generator().manual_seed(1)

        def random_logits(_module, _args, logits):
            return torch.randn(logits.shape, generator=routing)

        for module in llm.engine.executor.runner.model.modules():
            if isinstance(module, SparseMoE):
                module.gate.register_forward_hook(random_logits)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # warm
    print(f"# {machine()}\n# {args.model.name}: {experts} experts a layer, {used} a token; "
          f"routing: {args.routing}")  # fmt: skip
    print("| batch | experts read a layer (measured) | expected | step ms | weights read GB "
          "| GB/s | tok/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for batch in args.batches:
        tracer = StepTracer()
        llm.engine.add_observer(tracer)
        prompts = [
            {"prompt_token_ids": torch.randint(0, vocab, (PROMPT,), generator=generator).tolist()}
            for _ in range(batch)
        ]
        llm.generate(prompts, params, use_tqdm=False)
        llm.engine.remove_observer(tracer)
        decodes = [
            s for s in tracer.steps if s["decode_tokens"] == batch and not s["prefill_tokens"]
        ]
        step_s = statistics.median(s["end"] - s["start"] for s in decodes)
        read = statistics.median(s["experts_read"] for s in decodes)
        expected = expected_experts(experts, used, batch)
        weights = other + stacks * expected / experts
        print(
            f"| {batch} | {read:.1f} | {expected:.1f} | {step_s * 1e3:.1f} | {weights / 1e9:.2f} "
            f"| {weights / step_s / 1e9:.1f} | {batch / step_s:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
