"""Speculative decoding on the bundled pair (stdlib-lm, stdlib-lm-draft): TPOT and
throughput at several batch sizes, without speculation, with n-gram lookup and with the
draft model, on two workloads:

- held-out code: 256-token windows of stdlib files the models never saw, continued
  greedily (code repeats itself: n-gram lookup has something to find);
- code, penalized: the same, with the bundled model's recommended repetition penalty
  (1.3), which steers the target away from the repeats n-gram lookup proposes;
- free generation: 8-token openers of the same files, sampled (temperature 0.8,
  top-p 0.95, seeded): the model's own text, less predictable.

Beside each: the acceptance rate a, the mean acceptance length (tokens per
verification) and the formula's expectation (1 - a^(k+1)) / (1 - a) for i.i.d.
acceptance. Speculation is forced on at every batch size here (disable_by_batch_size
off) to show where it stops paying.

    python -m benchmarks.speculative_decoding [--batches 1 4 8 16] [--k 4] [--repeats 3]
        [--methods ngram draft] [--workloads "held-out code" "free generation"]

With ``--model smollm2-135m-instruct`` (a real model; ``--quantization none`` for its
float32 path) the workloads are the real model's, every prompt in its chat template,
answered greedily:

- chat: questions about held-out stdlib functions ("what does X do?", with the first
  line of its docstring);
- code: continue a held-out stdlib function from its first lines;
- agentic edit: rewrite a held-out function with one name changed (the answer copies
  most of the prompt, as editing and tool-using agents do);

and the methods are n-gram, suffix decoding, layer skipping (``--skip-layers`` as
``tandem tune-layer-skip`` printed) and, with ``--eagle DIR`` (a head from ``tandem
train-draft``), the EAGLE head, each adaptive (the default: measured switch-off,
engine/spec_control.py) and forced on.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import textwrap
import time

from benchmarks.common import machine
from tandem import LLM, SamplingParams
from tandem.models.catalog import DEFAULT_MODEL
from tandem.models.tokenizer import Tokenizer
from tandem.train.corpus import split, stdlib_root, stdlib_sources

OUTPUT_TOKENS = 128


def heldout_prompts(count: int, length: int) -> list[list[int]]:
    tokenizer = Tokenizer(DEFAULT_MODEL)
    _, heldout = split(stdlib_sources(stdlib_root()))
    prompts = []
    for source in heldout:
        ids = tokenizer.encode(source.text)
        if len(ids) >= length + OUTPUT_TOKENS:
            start = len(ids) // 3  # past the imports and the module docstring
            prompts.append(ids[start : start + length])
        if len(prompts) == count:
            return prompts
    raise RuntimeError("not enough held-out files")


WORKLOADS = {
    "held-out code": dict(
        length=256, params=dict(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    ),
    # The bundled model's recommended sampling: greedy with a repetition penalty, which
    # steers away from the repeats n-gram lookup proposes.
    "code, penalized": dict(
        length=256,
        params=dict(
            temperature=0.0, repetition_penalty=1.3, max_tokens=OUTPUT_TOKENS, ignore_eos=True
        ),
    ),
    "free generation": dict(
        length=8,
        params=dict(temperature=0.8, top_p=0.95, max_tokens=OUTPUT_TOKENS, ignore_eos=True),
    ),
}


def heldout_functions(count: int) -> list[tuple[str, str, str, str]]:
    """(name, first docstring line, source, last parameter) of held-out stdlib functions
    and methods of 4-40 lines with a docstring and a parameter other than self."""
    _, heldout = split(stdlib_sources(stdlib_root()))
    found = []
    for source in heldout:
        try:
            tree = ast.parse(source.text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            doc = ast.get_docstring(node)
            if not params or not doc or not 4 <= node.end_lineno - node.lineno <= 40:
                continue
            code = ast.get_source_segment(source.text, node, padded=True)
            if code:
                code = textwrap.dedent(code)
                found.append((node.name, doc.strip().splitlines()[0], code, params[-1]))
            if len(found) == count:
                return found
    raise RuntimeError(f"not enough held-out functions ({len(found)} of {count})")


def real_model_prompts(llm: LLM, count: int) -> dict[str, list[list[int]]]:
    """The chat, code and agentic-edit prompts (module docstring), in the model's chat
    template."""
    tokenizer = llm.engine.tokenizer

    def chat(text: str) -> list[int]:
        return tokenizer.encode_chat([{"role": "user", "content": text}])

    prompts: dict[str, list[list[int]]] = {"chat": [], "code": [], "agentic edit": []}
    for name, doc, code, argument in heldout_functions(count):
        prompts["chat"].append(chat(
            f"In Python's standard library, what does the function `{name}` do? Its "
            f"docstring begins: \"{doc}\". Explain it in a few sentences."
        ))  # fmt: skip
        head = "\n".join(code.splitlines()[:3])
        prompts["code"].append(chat(f"Continue this Python function:\n```python\n{head}\n```"))
        prompts["agentic edit"].append(chat(
            f"Rewrite this function with the parameter `{argument}` renamed to "
            f"`{argument}_value`. Reply with the whole function only.\n```python\n{code}\n```"
        ))  # fmt: skip
    return prompts


REAL_PARAMS = dict(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)


def measure(llm: LLM, prompts: list[list[int]], params: dict, seed: int) -> dict[str, float]:
    before = llm.engine.spec_stats.copy()
    sampling = [SamplingParams(**params, seed=seed + i) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    elapsed = time.perf_counter() - start
    run = llm.engine.spec_stats.minus(before)
    return {
        "tpot": statistics.median(o.metrics.tpot for o in outputs),
        "throughput": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
        "acceptance": run.acceptance_rate,
        "length": run.mean_acceptance_length or 1.0,
    }


def expected_length(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-lm", help="stdlib-lm, or a real model")
    parser.add_argument("--quantization", default="auto", help="(a GGUF model) auto or none")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--skip-layers", default=None, help="layer_skip's (tune-layer-skip)")
    parser.add_argument("--eagle", default=None, metavar="DIR", help="an EAGLE head's folder")
    parser.add_argument("--workloads", nargs="+", default=None)
    args = parser.parse_args()
    bundled = args.model == "stdlib-lm"
    print(f"machine: {machine()}; {args.model} (quantization {args.quantization}), "
          f"{OUTPUT_TOKENS} output tokens, k = {args.k}, medians of {args.repeats}")  # fmt: skip
    k = args.k
    if bundled:  # speculation forced on at every batch size, as first measured
        settings = {
            "ngram": {"method": "ngram", "num_speculative_tokens": k, "adaptive": False},
            "draft": {"method": "draft", "num_speculative_tokens": k, "adaptive": False},
        }
    else:
        kinds = ["ngram", "suffix", "layer_skip", *(["eagle"] if args.eagle else [])]
        settings = {
            f"{method}{suffix}": {"method": method, "num_speculative_tokens": k,
                                  "adaptive": not forced, "skip_layers": args.skip_layers,
                                  "model": args.eagle if method == "eagle" else None}
            for method in kinds
            for suffix, forced in (("", False), (" (forced)", True))
        }  # fmt: skip
    methods = args.methods or list(settings)
    model = str(DEFAULT_MODEL) if bundled else args.model
    options = {} if bundled else {"quantization": args.quantization}
    engines = {"none": LLM(model, **options)}
    for name in methods:
        spec = {**settings[name], "disable_by_batch_size": None}
        engines[name] = LLM(model, speculative_config=spec, **options)
    if bundled:
        workloads = {name: WORKLOADS[name] for name in args.workloads or WORKLOADS}
        prompts = {
            name: heldout_prompts(max(args.batches), workload["length"])
            for name, workload in workloads.items()
        }
        params = {name: workload["params"] for name, workload in workloads.items()}
    else:
        # Each run gets prompts of its own: suffix decoding learns from earlier outputs,
        # and a repeat of the same prompts would find its own answers there.
        prompts = real_model_prompts(engines["none"], max(args.batches) * (args.repeats + 1))
        prompts = {name: prompts[name] for name in args.workloads or prompts}
        params = {name: REAL_PARAMS for name in prompts}
    print("| workload | batch | method | TPOT (ms) | TPOT speedup | tok/s | vs none | accept "
          "| len | formula |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for workload in prompts:
        for batch in args.batches:
            rows = {}
            pool = prompts[workload]
            sets = [pool[:batch]] * (args.repeats + 1) if bundled else [
                pool[run * batch : (run + 1) * batch] for run in range(args.repeats + 1)
            ]  # fmt: skip
            for name, llm in engines.items():
                measure(llm, sets[0], params[workload], seed=0)  # warm up
                runs = [
                    measure(llm, sets[r + 1], params[workload], seed=r) for r in range(args.repeats)
                ]
                rows[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            base = rows["none"]
            for name, r in rows.items():
                spec_cols = (
                    f"{r['acceptance']:.0%} | {r['length']:.2f} | "
                    f"{expected_length(r['acceptance'], k):.2f}"
                    if name != "none"
                    else " | | "
                )
                print(
                    f"| {workload} | {batch} | {name} | {r['tpot'] * 1e3:.2f} | "
                    f"{base['tpot'] / r['tpot']:.2f}x | {r['throughput']:.0f} | "
                    f"{r['throughput'] / base['throughput']:.2f}x | {spec_cols} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
