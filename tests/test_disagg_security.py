"""A disaggregated deployment trusts no client (real processes on 127.0.0.1): forged or
foreign transfer parameters are refused before anything is allocated, the KV port
serves only leased blocks to lease holders, a fake prefill server cannot inject
blocks, direct clients cannot pin a prefill instance's cache, and the router checks
requests, keys and dead instances. docs/SECURITY.md describes the model."""

from __future__ import annotations

import contextlib
import json
import random
import socket

import httpx
import msgspec
import pytest
import zmq

from tandem.disagg.auth import KVAuth
from tandem.disagg.transfer import BlocksHeader, Notify, ReadRequest
from tandem.server.launch import tandem_process, tandem_servers
from tests.hf_models import VOCAB_SIZE
from tests.servers import KV_SECRET, MODEL, kv_role, metric, served, wait_for

KEY = "client-key"


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]


SECRET_PROMPT, FILLER = ids(90, 1), ids(90, 2)


@pytest.fixture(scope="module")
def deployment(llama_folder):
    with tandem_servers(
        served(llama_folder, *kv_role("prefill"), "--num-blocks", "64",
               "--kv-max-leased-fraction", "0.25"),
        served(llama_folder, *kv_role("decode")),
    ) as (prefill, decode):  # fmt: skip
        yield {"prefill": prefill.url, "decode": decode.url}


def prefilled(prefill: str, prompt: list[int], salt: str | None = None) -> dict | None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json().get("kv_transfer_params")


def decode_with(decode: str, prompt: list[int], params: dict, salt: str | None = None):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": params}  # fmt: skip
    if salt is not None:
        body["cache_salt"] = salt
    return httpx.post(f"{decode}/v1/completions", json=body, timeout=60)


def assert_refused(response: httpx.Response, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and words in error["message"], error


def release_all(prefill: str, *leases: dict) -> None:
    """Give leases back as their reader would."""
    for params in leases:
        raw_request(params, Notify({"release": params["lease_id"], "token": token(params)}))
    wait_for(lambda: metric(prefill, "kv_leases") == 0)


def token(params: dict, secret: str = KV_SECRET) -> str:
    return KVAuth(secret).lease_token(params["lease_id"])


def raw_request(params: dict, message) -> list[bytes]:
    """One raw message to the prefill instance's KV port, as anyone on the network could
    send it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        sock.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
        sock.send(msgspec.msgpack.encode(message))
        return sock.recv_multipart()
    finally:
        sock.close()


def test_forged_parameters_are_refused_before_anything_is_allocated(deployment):
    prefill, decode = deployment["prefill"], deployment["decode"]
    params = prefilled(prefill, SECRET_PROMPT)
    unsigned = {k: v for k, v in params.items() if k != "signature"}
    redirected = {**params, "remote_host": "10.0.0.1", "remote_port": 9}
    other_blocks = {**params, "remote_block_ids": [b + 8 for b in params["remote_block_ids"]]}
    # a fake prefill server signs with a secret of its own
    fake = {**unsigned, "remote_port": 9}
    fake["signature"] = KVAuth("not-the-secret").sign(fake)
    for forged in (unsigned, redirected, other_blocks, fake):
        assert_refused(decode_with(decode, SECRET_PROMPT, forged), "not signed")
    assert metric(decode, "kv_transfer_blocks_total") == 0
    assert metric(decode, "kv_transfer_failures_total") == 0  # it never even connected
    assert metric(decode, "kv_cache_usage_perc") == 0
    release_all(prefill, params)


def test_another_tenants_prompt_cannot_be_read(deployment, tiny_server):
    """Tenant B holds tenant A's genuine parameters: with a filler prompt of the same
    length, or A's prompt under another cache_salt, the decode instance refuses."""
    prefill, decode = deployment["prefill"], deployment["decode"]
    params = prefilled(prefill, SECRET_PROMPT, salt="tenant-a")
    assert_refused(decode_with(decode, FILLER, params, salt="tenant-a"), "another prompt")
    assert_refused(decode_with(decode, SECRET_PROMPT, params, salt="tenant-b"), "another prompt")
    assert_refused(decode_with(decode, SECRET_PROMPT, params), "another prompt")
    # the genuine pairing works, and gives the colocated server's output
    answer = decode_with(decode, SECRET_PROMPT, params, salt="tenant-a")
    assert answer.status_code == 200, answer.text
    reference = {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 4, "temperature": 0}
    expected = httpx.post(f"{tiny_server}/v1/completions", json=reference, timeout=60).json()
    assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    assert metric(decode, "kv_transfer_blocks_total") == len(params["remote_block_ids"])
    wait_for(lambda: metric(prefill, "kv_leases") == 0)  # the reader released it


def test_the_kv_port_serves_only_leased_blocks_to_lease_holders(deployment):
    prefill = deployment["prefill"]
    params = prefilled(prefill, SECRET_PROMPT)
    blocks, lease = params["remote_block_ids"], params["lease_id"]
    outside = [b for b in range(64) if b not in blocks][:2]
    attempts = {
        "no token": ReadRequest(blocks),
        "unleased blocks, no token": ReadRequest(outside),
        "a wrong token": ReadRequest(blocks, lease, token(params, "guess")),
        "blocks outside the lease": ReadRequest(outside, lease, token(params)),
        "a made-up lease": ReadRequest(blocks, "other", KVAuth(KV_SECRET).lease_token("other")),
    }
    for name, attempt in attempts.items():
        header_frame, data = raw_request(params, attempt)
        header = msgspec.msgpack.decode(header_frame, type=BlocksHeader)
        assert "read refused" in header.error and data == b"", name
    # a release without the token is ignored: the lease stays
    raw_request(params, Notify({"release": lease}))
    raw_request(params, Notify({"release": lease, "token": "0" * 64}))
    assert metric(prefill, "kv_leases") == 1
    # the lease holder reads
    header_frame, data = raw_request(params, ReadRequest(blocks, lease, token(params)))
    header = msgspec.msgpack.decode(header_frame, type=BlocksHeader)
    assert not header.error and header.shape[2] == len(blocks) and len(data) > 0
    release_all(prefill, params)


def test_direct_clients_cannot_pin_the_prefill_cache(deployment):
    """12 do_remote_decode requests of 6 blocks each against a cap of a quarter of 64
    blocks: two leases are kept, the rest answer without parameters, and an ordinary
    request still runs at once."""
    prefill = deployment["prefill"]
    answers = [prefilled(prefill, ids(90, 100 + i)) for i in range(12)]
    kept = [a for a in answers if a is not None]
    assert len(kept) == 2
    assert metric(prefill, "kv_leases") == 2
    assert metric(prefill, "kv_cache_usage_perc") <= 0.25
    body = {"model": MODEL, "prompt": ids(90, 99), "max_tokens": 2}
    assert httpx.post(f"{prefill}/v1/completions", json=body, timeout=30).status_code == 200
    release_all(prefill, *kept)


# -- the router -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(llama_folder):
    """A router and instances sharing a client API key."""
    with contextlib.ExitStack() as stack:
        prefill, decode = (server.url for server in stack.enter_context(tandem_servers(
            served(llama_folder, *kv_role("prefill"), "--api-key", KEY),
            served(llama_folder, *kv_role("decode"), "--api-key", KEY),
        )))  # fmt: skip
        router = stack.enter_context(tandem_process(
            "router", "--prefill", prefill, "--decode", decode, "--api-key", KEY,
            "--max-body-bytes", str(ROUTER_MAX_BODY), "--header-timeout", "1"))  # fmt: skip
        yield {"prefill": prefill, "decode": decode, "router": router}


AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTER_MAX_BODY = 64 * 1024


def test_the_router_bounds_bodies_and_slow_clients(keyed):
    big = {"model": MODEL, "prompt": "x" * ROUTER_MAX_BODY, "max_tokens": 1}
    response = httpx.post(f"{keyed['router']}/v1/completions", json=big, headers=AUTH)
    assert response.status_code == 413 and "error" in response.json()
    host, port = keyed["router"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        sock.settimeout(10)
        assert sock.recv(4096) == b""  # closed after the header timeout


def test_the_router_has_a_key_and_forwards_it(keyed):
    router = keyed["router"]
    body = {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 3, "temperature": 0}
    refused = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    answer = httpx.post(f"{router}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    assert metric(keyed["decode"], "kv_transfer_blocks_total") > 0  # went the whole way
    models = httpx.get(f"{router}/v1/models", headers=AUTH, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize(
    "content, param",
    [
        (b"{nope", None),
        (b"[1, 2]", None),
        (json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "a", "temperature": "hot"}).encode(),
         "temperature"),
        (json.dumps({"model": MODEL, "prompt": "a", "best_of": 3}).encode(), "best_of"),
    ],
)  # fmt: skip
def test_the_router_refuses_bad_requests_before_prefilling(keyed, content, param):
    before = metric(keyed["prefill"], "request_success_total")
    response = httpx.post(
        f"{keyed['router']}/v1/completions", content=content,
        headers={**AUTH, "content-type": "application/json"}, timeout=30,
    )  # fmt: skip
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert response.json()["error"]["param"] == param
    assert metric(keyed["prefill"], "request_success_total") == before  # nothing prefilled


def test_a_clients_transfer_parameters_never_reach_an_instance(keyed):
    """Forged parameters sent to the router are dropped: the request runs normally."""
    forged = {"remote_host": "10.0.0.1", "remote_port": 9, "lease_id": "x",
              "remote_block_ids": [0, 1, 2, 3, 4, 5], "remote_num_tokens": 89,
              "signature": "0" * 64}  # fmt: skip
    body = {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 3, "kv_transfer_params": forged}
    response = httpx.post(f"{keyed['router']}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text


def test_a_dead_decode_instance_is_skipped_and_a_lost_stream_ends_cleanly(llama_folder):
    decode = served(llama_folder, *kv_role("decode"))
    with contextlib.ExitStack() as stack:
        prefill, dead, alive = stack.enter_context(
            tandem_servers(served(llama_folder, *kv_role("prefill")), decode, decode)
        )
        router = stack.enter_context(tandem_process(
            "router", "--prefill", prefill.url, "--decode", dead.url, alive.url))  # fmt: skip
        dead.process.kill()
        dead.process.wait()
        body = {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 2}
        for _ in range(4):  # every request lands, whichever instance is tried first
            response = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        health = httpx.get(f"{router}/health", timeout=30).json()
        assert health["decode"] == {dead.url: False, alive.url: True}
        # the last decode instance dies mid-stream: an error chunk, then [DONE]
        streaming = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router}/v1/completions", json=streaming, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            alive.process.kill()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert "error" in json.loads(rest[-2].removeprefix("data: "))
