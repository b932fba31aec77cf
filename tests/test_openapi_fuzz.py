"""schemathesis against the server's own OpenAPI document: for a bounded number of
generated requests per operation, valid and invalid, the server answers within the
timeout, never with a 5xx, always in the documented shape (status code, content
type, OpenAI's error body), and refuses what the schema does not allow. The server
is small (64-token context, few prompts and samples per request) so that every
generated request finishes quickly.

The requests come from schemathesis's Python API (an operation's Hypothesis strategy
under `@given`), not from its pytest plugin: the plugin rewrites pytest's private node
ids and broke when pytest changed them (pytest 9.2), while a strategy is the
interface schemathesis documents for use inside any test."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tandem.server.launch import tandem_process

EXAMPLES_PER_OPERATION = 50


@pytest.fixture(scope="module")
def fuzzed_server(model_dirs):
    folder, _ = model_dirs("llama")
    with tandem_process(
        "serve", "--model", str(folder), "--served-model-name", "tiny", "--max-model-len", "64",
        "--max-n", "2", "--max-prompts", "4", "--log-level", "warning",
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def api_operations(fuzzed_server):
    schema = schemathesis.openapi.from_url(f"{fuzzed_server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    return operations


def check_answer(case, base_url: str) -> None:
    # Every check but "a schema-valid request is accepted": a valid shape can still ask
    # for more than the context or the vocabulary allows (a 400 naming the field).
    response = case.call_and_validate(
        base_url=base_url, timeout=30, excluded_checks=[positive_data_acceptance]
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        content_type = response.headers.get("content-type") or [""]
        assert content_type[0].startswith("application/json"), response.text
        if case.path.startswith("/v1/messages"):  # Anthropic's shape on its API's routes
            assert response.json()["type"] == "error"
            assert set(response.json()["error"]) == {"type", "message"}
        else:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_generated_requests_get_documented_answers(api_operations, fuzzed_server, mode):
    failures, fuzzed = [], []
    for operation in api_operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def generated_request_is_answered(case):
            check_answer(case, fuzzed_server)

        try:
            generated_request_is_answered()
        except Unsatisfiable:
            # No invalid request exists for an operation without a body or constrained
            # parameters (GET /health; a free-form path parameter): nothing to negate.
            assert mode == GenerationMode.NEGATIVE, operation.label
            continue
        except Exception as failure:  # every operation is fuzzed; all failures are reported
            failures.append(f"{operation.label}: {failure!r}")
        fuzzed.append(operation.label)
    assert not failures, "\n\n".join(failures)
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= set(fuzzed), fuzzed


# A request each route accepts, to which one field at a time is set past 64 bits.
USER = [{"role": "user", "content": "a"}]
VALID_BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "a", "max_tokens": 1},
    "/v1/chat/completions": {"model": "tiny", "messages": USER},
    "/v1/responses": {"model": "tiny", "input": "a"},
    "/v1/messages": {"model": "tiny", "max_tokens": 1, "messages": USER},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": USER},
    "/tokenize": {"model": "tiny", "prompt": "a"},
    "/detokenize": {"model": "tiny", "tokens": [1]},
}  # fmt: skip


def integer_fields(schema: dict, document: dict) -> dict[str, object]:
    """Each property of a request body that may hold an integer (or a list of them) ->
    a value past 64 bits for it."""

    def resolve(node: dict) -> dict:
        while "$ref" in node:
            node = document["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
        return node

    def options(node: dict) -> list[dict]:
        node = resolve(node)
        return [resolve(n) for n in node.get("anyOf", [node])]

    huge = {}
    for name, node in resolve(schema).get("properties", {}).items():
        for option in options(node):
            if option.get("type") == "integer":
                huge[name] = 2**70
            elif option.get("type") == "array" and any(
                o.get("type") == "integer" for o in options(option.get("items", {}))
            ):
                huge.setdefault(name, [2**70])
    return huge


def test_no_integer_past_64_bits_reaches_the_engine(fuzzed_server):
    """Every integer field of every route's body, set to 2^70, is a 4xx, never a 5xx
    (top_k 2^70 once reached the engine's wire encoder and came back a 500)."""
    document = httpx.get(f"{fuzzed_server}/openapi.json").json()
    checked = []
    for path, valid in VALID_BODIES.items():
        operation = document["paths"][path]["post"]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        for name, value in integer_fields(schema, document).items():
            response = httpx.post(f"{fuzzed_server}{path}", json={**valid, name: value}, timeout=30)
            assert 400 <= response.status_code < 500, (path, name, response.text)
            checked.append((path, name))
    assert ("/v1/completions", "top_k") in checked and ("/v1/messages", "max_tokens") in checked
    assert len(checked) > 15
