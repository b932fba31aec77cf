"""Structured outputs: a request's constraint as a grammar, and the token masks that
hold its generation to it. The grammar engine is llguidance.

Why llguidance rather than xgrammar (``python -m benchmarks.structured_outputs``;
docs/BENCHMARKS.md, "Serving"): it compiles a JSON schema one to two orders of
magnitude faster (a compile per request sits between two steps), and it needs nothing
else installed (xgrammar pulls in triton); its masks are slower, but small beside a
CPU decode step.

    StructuredOutputsParams (sampling.py)
      -> grammar_for(params), here (torch-free): llguidance's grammar text (checked
         at the door by InputProcessor: what the library cannot compile is a 400
         naming why)
      -> GrammarMatcher per running request (runner/grammar_masks.py, kept in the
         runner's RequestState): it consumes each accepted token and says which
         tokens may come next
      -> fill_masks: one bitmask row per sampling row, computed by llguidance's
         threads with the GIL released; apply_masks: the rows' disallowed logits
         become -inf in one vectorised pass (no Python loop over the vocabulary)

Speculative decoding: drafts are cut at the first token the grammar refuses before
the forward pass (``valid_prefix``), and each verified position is masked with the
grammar state after the drafts before it, so an accepted draft is always allowed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from tandem.errors import InvalidParameterError

if TYPE_CHECKING:
    from tandem.sampling import StructuredOutputsParams

# JSON is generated compact: a small model left free to add whitespace may add it
# forever (a JSON object can then never close within max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint; raises InvalidParameterError (naming
    the field) when the library cannot compile it."""
    import llguidance as llg  # on first use: an engine never constrained never loads it

    matcher = llg.LLMatcher
    field, value = params.constraint()
    try:
        if field == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            grammar = matcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        elif field == "json_object":
            grammar = matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        elif field == "regex":
            grammar = matcher.grammar_from_regex(value)
        elif field == "choice":
            lark = "start: " + " | ".join(json.dumps(choice) for choice in value)
            grammar = matcher.grammar_from_lark(lark)
        else:  # grammar: Lark, or llama.cpp's GBNF
            grammar = llg.grammar_from("grammar", value)
    except (ValueError, TypeError) as exc:
        raise InvalidParameterError(params.source, f"{field}: {exc}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise InvalidParameterError(params.source, f"{field}: {_first_lines(error)}")
    return grammar


def _first_lines(message: str, count: int = 4) -> str:
    return "\n".join(message.strip().splitlines()[:count])
