"""Structured outputs: every constrained answer parses and validates (jsonschema, the
regex, the choices), beside unconstrained requests that stay exactly as they were,
with and without speculative decoding and across preemptions; a constraint the
grammar library cannot compile is refused before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem import LLM, SamplingParams
from tandem.errors import InvalidParameterError
from tandem.models.catalog import is_installed
from tandem.sampling import StructuredOutputsParams

# Schemas whose every valid document is short, so that even a random-weight model,
# held to them, finishes well within max_tokens.
COLORED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["ok", "color", "name"],
    "additionalProperties": False,
}
SCHEMAS = [
    COLORED,
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "boolean"}, "y": {"enum": [1, 2, 3]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Describe the object as JSON:", "Numbers:", "Once upon a time", "def f(x):"]


@pytest.fixture(scope="module")
def tiny(model_dirs):
    return LLM(str(model_dirs("llama")[0]))


def constrained(spec: StructuredOutputsParams, **params) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_outputs=spec, **params)


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_answers_validate_beside_unconstrained_requests(tiny, temperature):
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS, free, use_tqdm=False)]
    params = [
        constrained(StructuredOutputsParams(json=schema), temperature=temperature, seed=i, n=2)
        for i, schema in enumerate(SCHEMAS)
    ]
    outputs = tiny.generate(
        [*PROMPTS[: len(SCHEMAS)], *PROMPTS], [*params, *[free] * len(PROMPTS)], use_tqdm=False
    )
    for output, schema in zip(outputs, SCHEMAS, strict=False):
        for sample in output.outputs:
            assert sample.finish_reason == "stop", sample.text
            check_json(sample.text, schema)
    # The masks touched only their own rows.
    assert [o.outputs[0].token_ids for o in outputs[len(SCHEMAS) :]] == alone
    tiny.engine.kv_manager.check_no_leaks()


def test_regex_choice_grammar_and_json_object_hold(tiny):
    specs = {
        "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
        "choice": StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        "grammar": StructuredOutputsParams(grammar='start: "(" NUM ("," NUM)~0..2 ")"\n'
                                           "NUM: /[1-9]/"),
        "gbnf": StructuredOutputsParams(grammar='root ::= "ab" [c-e]{2}'),
        "json_object": StructuredOutputsParams(json_object=True),
    }  # fmt: skip
    names = list(specs)
    outputs = tiny.generate(
        ["Answer:"] * len(specs),
        [constrained(specs[name], temperature=1.0, seed=7) for name in names],
        use_tqdm=False,
    )
    texts = dict(zip(names, (o.outputs[0].text for o in outputs), strict=True))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts["regex"])
    assert texts["choice"] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\([1-9](,[1-9]){0,2}\)", texts["grammar"])
    assert re.fullmatch(r"ab[c-e]{2}", texts["gbnf"])
    finish = outputs[names.index("json_object")].outputs[0].finish_reason
    if finish == "stop":  # an object may be long: only a finished one must parse
        assert isinstance(json.loads(texts["json_object"]), dict)


def test_speculation_and_preemption_under_a_grammar_are_lossless(model_dirs):
    """Greedy constrained outputs are the same with n-gram drafts (cut where the
    grammar refuses them, masked per position) and with a cache so small that the
    requests are preempted and resumed (the grammar state rebuilt from the output)."""
    folder = str(model_dirs("llama")[0])
    schema = {"type": "array", "items": {"enum": ["ab", "abc", "b"]}, "maxItems": 12}
    params = [constrained(StructuredOutputsParams(json=schema), temperature=0)] * 4
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6] * 3, [9, 8] * 10, [3, 4, 3, 4, 3], [11] * 9]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(folder).generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    speculating = LLM(folder, speculative_config=spec)
    drafted = speculating.generate(prompts, params, use_tqdm=False)
    squeezed = LLM(folder, num_blocks=30, block_size=4).generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in plain]
    for text in texts:
        check_json(text, schema)
    assert [o.outputs[0].text for o in drafted] == texts
    assert [o.outputs[0].text for o in squeezed] == texts
    assert speculating.engine.spec_stats.num_drafts > 0
    assert sum(o.metrics.num_preemptions for o in squeezed) > 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "nowhere"),
        ({"json": "{not json"}, "json"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"choice": []}, "choice"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ],
)
def test_an_uncompilable_constraint_is_refused_before_queueing(tiny, spec, message):
    with pytest.raises(InvalidParameterError) as refused:
        tiny.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert message in str(refused.value) and refused.value.param == "structured_outputs"
    assert not tiny.engine.has_unfinished_requests()


@pytest.mark.skipif(not is_installed("smollm2-135m-instruct"), reason="SmolLM2 not installed")
def test_a_real_model_answers_in_the_schema():
    llm = LLM("smollm2-135m-instruct")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "languages": {"type": "array", "items": {"type": "string", "maxLength": 20},
                          "maxItems": 4},
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": False,
    }  # fmt: skip
    question = [{"role": "user", "content": "Invent a programmer. Reply in JSON."}]
    params = [constrained(StructuredOutputsParams(json=schema), temperature=0.8, seed=s)
              for s in range(4)]  # fmt: skip
    for output in llm.chat([question] * 4, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        check_json(output.outputs[0].text, schema)
