"""Structured outputs: what a grammar costs. (1) The grammar libraries on the same
schemas and vocabulary: compile time per schema and mask time per token, walking a
valid document token by token (llguidance, which tandem uses, and xgrammar when it
is importable, for the comparison that chose it). (2) The engine: the same chat
requests free and held to a JSON schema, output tok/s and TPOT in one run.

    python -m benchmarks.structured_outputs [--model smollm2-135m-instruct] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import machine
from tandem import LLM, SamplingParams
from tandem.engine.grammar import grammar_for
from tandem.models.catalog import is_installed
from tandem.plan.measure import median_time
from tandem.runner.grammar_masks import apply_masks, grammar_tokenizer, new_masks
from tandem.sampling import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "status": {"enum": ["new", "paid", "shipped", "delivered", "returned"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
            },
        },
        "address": {
            "type": "object",
            "properties": {k: {"type": "string"} for k in ("street", "city", "zip", "country")},
            "required": ["street", "city", "country"],
        },
    },
    "required": ["id", "status", "items"],
}
WIDE = {
    "type": "object",
    "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"]} for i in range(60)},
    "required": [f"field_{i}" for i in range(0, 60, 3)],
}
SCHEMAS = {
    "person": (PERSON, {"name": "Ada Lovelace", "age": 36, "languages": ["English"]}),
    "order": (
        ORDER,
        {
            "id": "ABC-123456",
            "status": "paid",
            "items": [{"sku": "X1", "quantity": 2, "price": 9.5}],
            "address": {"street": "1 Main St", "city": "Oslo", "country": "NO"},
        },
    ),
    "60 fields": (WIDE, {f"field_{i}": i for i in range(0, 60, 3)}),
}


def llguidance_costs(tokenizer, vocab: int, eos: tuple[int, ...], repeats: int) -> dict:
    import llguidance

    from tandem.runner.grammar_masks import GrammarMatcher, fill_masks

    llg_tokenizer = grammar_tokenizer(tokenizer, vocab, eos)
    results = {}
    for name, (schema, document) in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)

        def compile_once(spec=spec):
            llguidance.LLMatcher(llg_tokenizer, grammar_for(spec))

        compile_s = median_time(compile_once, repeats)
        tokens = tokenizer.encode(json.dumps(document, separators=(",", ":")), False)
        matcher = GrammarMatcher(grammar_for(spec), llg_tokenizer)
        masks = new_masks(1, vocab)
        start = time.perf_counter()
        for token in tokens:
            fill_masks([(matcher, 0)], masks)
            matcher.consume([token])
        per_token = (time.perf_counter() - start) / len(tokens)
        results[name] = (compile_s, per_token, len(tokens))
    return results


def xgrammar_costs(tokenizer, vocab: int, eos: tuple[int, ...], repeats: int) -> dict | None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    from tokenizers import Tokenizer as Backend

    hf = PreTrainedTokenizerFast(tokenizer_object=Backend.from_str(tokenizer.backend_json()))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(eos))
    results = {}
    for name, (schema, document) in SCHEMAS.items():
        text = json.dumps(schema)

        def compile_once(text=text):  # a fresh compiler: no cache across repeats
            xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
                text, any_whitespace=False
            )

        compile_s = median_time(compile_once, repeats)
        compiled = xgrammar.GrammarCompiler(info).compile_json_schema(text, any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        masks = xgrammar.allocate_token_bitmask(1, vocab)
        tokens = tokenizer.encode(json.dumps(document, separators=(",", ":")), False)
        start = time.perf_counter()
        for token in tokens:
            matcher.fill_next_token_bitmask(masks)
            matcher.accept_token(token)
        per_token = (time.perf_counter() - start) / len(tokens)
        results[name] = (compile_s, per_token, len(tokens))
    return results


def apply_cost(vocab: int, rows: int, repeats: int) -> float:
    """Seconds to apply ``rows`` bitmask rows to a batch of logits (tandem's kernel)."""
    import torch

    masks = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(rows, vocab)
    with torch.inference_mode():
        apply_masks(logits, masks, list(range(rows)))  # builds the kernels if needed
        return median_time(lambda: apply_masks(logits, masks, list(range(rows))), repeats * 20)


def engine_costs(llm: LLM, repeats: int) -> dict[str, tuple[float, float]]:
    """(output tok/s, median TPOT ms) of 8 chat requests, free and held to PERSON."""
    question = [{"role": "user", "content": "Invent a person. Reply in JSON with name, age, "
                 "and the languages they speak."}]  # fmt: skip
    runs: dict[str, list[tuple[float, float]]] = {"free": [], "json schema": []}
    for _ in range(repeats):
        for label, spec in (("free", None), ("json schema", StructuredOutputsParams(json=PERSON))):
            params = [
                SamplingParams(max_tokens=96, temperature=0.7, seed=s, structured_outputs=spec)
                for s in range(8)
            ]
            start = time.perf_counter()
            outputs = llm.chat([question] * 8, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            tpot = statistics.median(o.metrics.tpot for o in outputs if o.metrics.tpot)
            runs[label].append((tokens / elapsed, tpot * 1e3))
    return {
        label: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        for label, rs in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "smollm2-135m-instruct" if is_installed("smollm2-135m-instruct") else "stdlib-lm"
    parser.add_argument("--model", default=default)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    print(f"machine: {machine()}")
    llm = LLM(options.model)
    info = llm.engine.model_info
    tokenizer, vocab, eos = info.tokenizer, info.vocab_size, info.eos_token_ids
    print(f"model: {options.model} (vocabulary {vocab}); medians of {options.repeats}\n")
    libraries = {"llguidance": llguidance_costs(tokenizer, vocab, eos, options.repeats)}
    xgrammar_results = xgrammar_costs(tokenizer, vocab, eos, options.repeats)
    if xgrammar_results is not None:
        libraries["xgrammar"] = xgrammar_results
    print(f"{'library':<12}{'schema':<12}{'compile ms':>11}{'mask us/token':>15}{'tokens':>8}"
          "   (mask: computing the allowed tokens, then advancing by one)")  # fmt: skip
    for library, results in libraries.items():
        for name, (compile_s, per_token, count) in results.items():
            print(f"{library:<12}{name:<12}{compile_s * 1e3:>11.2f}{per_token * 1e6:>15.1f}"
                  f"{count:>8}")  # fmt: skip
    if xgrammar_results is None:
        print("(xgrammar is not importable here: its rows are missing)")
    for rows in (1, 16):
        cost = apply_cost(vocab, rows, options.repeats)
        print(f"applying {rows} mask rows to the logits (tandem's kernel): {cost * 1e6:.0f} us")
    print(f"\n{'engine, 8 chat requests':<26}{'out tok/s':>10}{'TPOT p50 ms':>13}")
    for label, (throughput, tpot) in engine_costs(llm, options.repeats).items():
        print(f"{label:<26}{throughput:>10.0f}{tpot:>13.1f}")


if __name__ == "__main__":
    main()
