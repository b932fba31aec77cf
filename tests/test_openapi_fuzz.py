"""schemathesis against the server's own OpenAPI document: for a bounded number of
generated requests per operation, valid and invalid, the server answers within the
timeout, never with a 5xx, always in the documented shape (status code, content
type, OpenAI's error body), and refuses what the schema does not allow. The server
is small (64-token context, few prompts and samples per request) so that every
generated request finishes quickly."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
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
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_generated_requests_get_documented_answers(case, fuzzed_server):
    # Every check but "a schema-valid request is accepted": a valid shape can still ask
    # for more than the context or the vocabulary allows (a 400 naming the field).
    response = case.call_and_validate(
        base_url=fuzzed_server, timeout=30, excluded_checks=[positive_data_acceptance]
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        content_type = response.headers.get("content-type") or [""]
        assert content_type[0].startswith("application/json"), response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
