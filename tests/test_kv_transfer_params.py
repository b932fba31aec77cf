"""kv_transfer_params from a client: every field is typed and range-checked at the
door, with the field named; nothing is silently dropped or reinterpreted."""

from __future__ import annotations

import pytest

from tandem.engine.kv_transfer_params import KVTransferParams
from tandem.errors import InvalidParameterError

GOOD = {
    "remote_block_ids": [4, 9, 2], "remote_num_tokens": 40, "lease_id": "abc",
    "remote_host": "127.0.0.1", "remote_port": 5555, "remote_engine_id": "e1",
}  # fmt: skip


def parse(**changes):
    return KVTransferParams.parse({**GOOD, **changes}, num_prompt_tokens=41, block_size=16)


def test_a_well_formed_request_parses_whole():
    params = parse()
    assert params.remote_block_ids == (4, 9, 2) and params.remote_num_tokens == 40
    assert (params.remote_host, params.remote_port, params.lease_id) == ("127.0.0.1", 5555, "abc")
    assert KVTransferParams.parse({"do_remote_decode": True}, 10, 16).do_remote_decode


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_port", "5555"), ("remote_port", 0), ("remote_port", 70000),
        ("remote_port", True), ("remote_host", 127), ("lease_id", ["x"]),
        ("remote_engine_id", 3), ("do_remote_decode", "false"),
        ("remote_num_tokens", True), ("remote_num_tokens", 41), ("remote_block_ids", [4, 9]),
        ("remote_block_ids", [4, 9, -1]), ("remote_block_ids", [4, 9, False]),
    ],
)  # fmt: skip
def test_a_bad_field_is_named(field, value):
    with pytest.raises(InvalidParameterError) as error:
        parse(**{field: value})
    assert error.value.param == f"kv_transfer_params.{field}"
