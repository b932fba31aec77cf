"""Disaggregated serving with real processes on 127.0.0.1: prefill and decode instances
behind the router give the colocated server's greedy outputs; requests spread over
decode instances; faults (a decode side that never comes back, a dead prefill instance,
a failed pull, a client that hangs up) leave no block in use anywhere."""

from __future__ import annotations

import contextlib
import json
import random

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.disagg.auth import KVAuth, prompt_digest
from tandem.engine.kv_connector import FinishedTransfer
from tandem.engine.observer import EngineObserver
from tandem.server.launch import tandem_process, tandem_servers
from tests.hf_models import VOCAB_SIZE
from tests.servers import KV_SECRET, MODEL, kv_role, metric, serve, served, wait_for


def idle(base_url: str) -> bool:
    return all(
        metric(base_url, name) == 0
        for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
                     "kv_leases")
    )  # fmt: skip


@pytest.fixture(scope="module")
def cluster(llama_folder):
    """One prefill instance, two decode instances, a router in front."""
    decode = served(llama_folder, *kv_role("decode"))
    with tandem_servers(
        served(llama_folder, *kv_role("prefill"), "--kv-lease-seconds", "3"), decode, decode
    ) as (prefill, *decodes):
        decodes = [d.url for d in decodes]
        with tandem_process("router", "--prefill", prefill.url, "--decode", *decodes) as router:
            yield {"prefill": prefill.url, "decodes": decodes, "router": router}


def prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]  # noqa: E731
    return {"long": ids(90), "block multiple": ids(64), "short": ids(5), "two tokens": ids(2)}


def complete(base_url: str, prompt, stream: bool, max_tokens: int = 12) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if not stream:
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.parametrize("stream", [False, True])
def test_outputs_equal_the_colocated_server(cluster, tiny_server, stream):
    for name, prompt in prompts().items():
        expected = complete(tiny_server, prompt, stream=False)
        assert complete(cluster["router"], prompt, stream) == expected, name
    wait_for(lambda: idle(cluster["prefill"]))
    assert metric(cluster["prefill"], "kv_lease_expiries_total") == 0  # every lease was read


def test_requests_spread_over_decode_instances(cluster):
    before = [metric(url, "kv_transfer_blocks_total") for url in cluster["decodes"]]
    for prompt in prompts().values():
        complete(cluster["router"], prompt, stream=False, max_tokens=2)
    after = [metric(url, "kv_transfer_blocks_total") for url in cluster["decodes"]]
    assert all(b > a for a, b in zip(before, after, strict=True))
    for url in [cluster["prefill"], *cluster["decodes"]]:
        wait_for(lambda url=url: idle(url))


def test_a_decode_side_that_never_comes_back_leaks_nothing(cluster):
    prefill = cluster["prefill"]
    body = {"model": MODEL, "prompt": prompts()["long"], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    answer = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60).json()
    params = answer["kv_transfer_params"]
    assert params["remote_num_tokens"] == 89 and len(params["remote_block_ids"]) == 6
    assert params["remote_port"] > 0 and metric(prefill, "kv_leases") == 1
    assert metric(prefill, "kv_cache_usage_perc") > 0  # held for the decode side...
    wait_for(lambda: idle(prefill), timeout=15)  # ...until the 3 s lease expires
    assert metric(prefill, "kv_lease_expiries_total") >= 1


def signed(params: dict, prompt: list[int], secret: str = KV_SECRET, salt=None) -> dict:
    """Parameters as a prefill instance of the deployment (holding ``secret``) would
    return them for ``prompt``."""
    digest = prompt_digest(prompt[: params["remote_num_tokens"]], salt)
    params = {"remote_engine_id": None, **params, "prompt_digest": digest}
    return {**params, "signature": KVAuth(secret).sign(params)}


def test_a_failed_pull_recomputes_or_fails_by_setting(llama_folder, tiny_server):
    prompt = prompts()["long"]
    bogus = signed({"remote_host": "127.0.0.1", "remote_port": 9,
                    "remote_block_ids": list(range(6)), "remote_num_tokens": 89,
                    "lease_id": "gone"}, prompt)  # fmt: skip
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": bogus}  # fmt: skip
    expected = complete(tiny_server, prompt, stream=False)
    for policy in ("recompute", "fail"):
        with serve(llama_folder, *kv_role("decode"), "--kv-transfer-failure", policy) as decode:
            response = httpx.post(f"{decode}/v1/completions", json=body, timeout=60)
            if policy == "recompute":
                assert response.status_code == 200
                assert response.json()["choices"][0]["text"] == expected
            else:
                assert response.status_code == 500
                message = response.json()["error"]["message"]
                assert "could not read the prompt's KV" in message and "connect" in message
            assert metric(decode, "kv_transfer_failures_total") == 1
            wait_for(lambda decode=decode: idle(decode))


def test_a_dead_prefill_instance_is_skipped_then_reported(llama_folder, tiny_server):
    prompt = prompts()["block multiple"]
    prefill = served(llama_folder, *kv_role("prefill"))
    with contextlib.ExitStack() as stack:
        dying, alive, decode = stack.enter_context(
            tandem_servers(prefill, prefill, served(llama_folder, *kv_role("decode")))
        )
        alive, decode = alive.url, decode.url
        router, lonely = (server.url for server in stack.enter_context(tandem_servers(
            ("router", "--prefill", dying.url, alive, "--decode", decode),
            ("router", "--prefill", dying.url, "--decode", decode),
        )))  # fmt: skip
        dying.process.kill()
        dying.process.wait()
        expected = complete(tiny_server, prompt, stream=False)
        for _ in range(2):  # whichever prefill instance is tried first, the answer comes
            assert complete(router, prompt, stream=False) == expected
        response = httpx.post(f"{lonely}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2})  # fmt: skip
        assert response.status_code == 502
        assert "no prefill instance" in response.json()["error"]["message"]
        health = httpx.get(f"{lonely}/health", timeout=30)
        assert health.status_code == 503
        assert health.json() == {"prefill": {dying.url: False}, "decode": {decode: True}}
        assert httpx.get(f"{router}/health", timeout=30).status_code == 200


def aborted(urls) -> float:
    return sum(metric(url, "request_success_total", finished_reason="abort") for url in urls)


def test_a_client_hanging_up_frees_everything(cluster):
    before = aborted(cluster["decodes"])
    body = {"model": MODEL, "prompt": prompts()["long"], "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{cluster['router']}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
    for url in [cluster["prefill"], *cluster["decodes"]]:
        wait_for(lambda url=url: idle(url))
    assert aborted(cluster["decodes"]) == before + 1  # the decode request was aborted


def test_a_killed_decode_instance_leaves_the_prefill_side_clean(llama_folder):
    with contextlib.ExitStack() as stack:
        prefill, decode = stack.enter_context(tandem_servers(
            served(llama_folder, *kv_role("prefill"), "--kv-lease-seconds", "2"),
            served(llama_folder, *kv_role("decode")),
        ))  # fmt: skip
        prefill = prefill.url
        router = stack.enter_context(
            tandem_process("router", "--prefill", prefill, "--decode", decode.url)
        )
        body = {"model": MODEL, "prompt": prompts()["long"], "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            decode.process.kill()
            with contextlib.suppress(httpx.HTTPError):
                for _ in lines:
                    pass
        wait_for(lambda: idle(prefill), timeout=15)
        response = httpx.post(f"{router}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompts()["short"], "max_tokens": 2})  # fmt: skip
        assert response.status_code == 502  # reported, not hung
        wait_for(lambda: idle(prefill), timeout=15)


class HeldPulls:
    """A KV connector whose receives end when the test says so (the seam's contract,
    without a transport)."""

    num_leases = num_lease_expiries = 0

    def __init__(self):
        self.started, self.ended = {}, []

    def check(self, request):
        pass

    def num_remote_tokens(self, request):
        return request.kv_transfer.remote_num_tokens if request.kv_transfer else 0

    def on_blocks_allocated(self, request, block_ids, num_tokens):
        self.started[request.request_id] = (block_ids, num_tokens)

    def request_finished(self, request, block_ids):
        return False, None

    def finished_transfers(self):
        ended, self.ended = self.ended, []
        return ended


REMOTE = {"remote_block_ids": list(range(6)), "remote_num_tokens": 89, "lease_id": "x"}


def test_an_abort_during_the_pull_frees_the_blocks_once_it_ends(llama_folder):
    engine = LLM(llama_folder, block_size=16).engine
    connector = HeldPulls()
    engine.set_kv_connector(connector)
    prompt = prompts()["long"]
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("pulling", {"prompt_token_ids": prompt}, params, kv_transfer_params=REMOTE)
    assert connector.started["pulling"][1] == 89
    assert len(engine.kv_manager.block_table("pulling")) == 6  # blocks for 89 tokens
    assert not engine.has_unfinished_requests()  # parked: nothing to step
    engine.abort("pulling")  # the client left while the agent is still writing...
    assert len(engine.kv_manager.block_table("pulling")) == 6  # ...so the blocks stay
    connector.ended.append(FinishedTransfer("pulling", ok=True))
    assert engine.poll_kv_transfers() == []  # until the pull ends
    engine.kv_manager.check_no_leaks()
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("outcome", ["ok", "recompute", "fail"])
def test_a_parked_request_runs_recomputes_or_fails_when_its_pull_ends(llama_folder, outcome):
    """After a pull ends the request runs from the pulled tokens (only the last prompt
    token is computed here), recomputes its prompt, or fails, with nothing leaked."""
    engine = LLM(llama_folder, block_size=16).engine
    connector = HeldPulls()
    engine.set_kv_connector(connector)
    prompt = prompts()["long"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompt}, params, kv_transfer_params=REMOTE)
    connector.ended.append(FinishedTransfer("r", outcome == "ok", outcome == "recompute"))
    failed = engine.poll_kv_transfers()
    assert failed == (["r"] if outcome == "fail" else [])
    steps = StepTokens()
    engine.add_observer(steps)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    if outcome == "fail":
        assert not outputs and not steps.tokens
    else:
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
        # The first step ran the last prompt token only, or the whole prompt again.
        assert steps.tokens[0] == (1 if outcome == "ok" else len(prompt))
    engine.kv_manager.check_no_leaks()


class StepTokens(EngineObserver):
    def __init__(self):
        self.tokens = []

    def step_done(self, out, stats):
        if out is not None:
            self.tokens.append(stats.num_batched_tokens)


def test_short_prompts_and_n_samples_skip_the_prefill_instance(cluster, tiny_server):
    decodes = cluster["decodes"]
    with tandem_process(
        "router", "--prefill", cluster["prefill"], "--decode", *decodes,
        "--local-prefill-threshold", "32",
    ) as router:  # fmt: skip
        before = sum(metric(url, "kv_transfer_blocks_total") for url in decodes)
        short = prompts()["short"]
        assert complete(router, short, stream=False) == complete(tiny_server, short, False)
        body = {"model": MODEL, "prompt": prompts()["long"], "max_tokens": 3, "n": 2}
        assert len(httpx.post(f"{router}/v1/completions", json=body, timeout=60)
                   .json()["choices"]) == 2  # fmt: skip
        assert sum(metric(url, "kv_transfer_blocks_total") for url in decodes) == before
        complete(router, prompts()["long"], stream=False, max_tokens=2)  # long: moved
        assert sum(metric(url, "kv_transfer_blocks_total") for url in decodes) > before


def test_a_colocated_server_ignores_transfer_parameters(tiny_server):
    """Without a prefill or decode role nothing could pull or expire a lease: the request
    is computed as any other, and nothing stays held."""
    prompt = prompts()["long"]
    expected = complete(tiny_server, prompt, stream=False)
    for params in (
        {"do_remote_decode": True},
        {"remote_host": "127.0.0.1", "remote_port": 9, "remote_block_ids": list(range(6)),
         "remote_num_tokens": 89, "lease_id": "x"},
    ):  # fmt: skip
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "kv_transfer_params": params}  # fmt: skip
        answer = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == expected and "kv_transfer_params" not in answer
        wait_for(lambda: idle(tiny_server))


def test_tensor_parallel_instances_equal_the_colocated_server(llama_folder, tiny_server):
    """A prefill instance of 2 ranks and decode instances of 2 and of 1: rank 0 of each
    moves every rank's KV heads (runner/shared_kv.py), so the blocks that cross are
    whole, whatever either side's rank count."""
    tp2 = ("--tensor-parallel-size", "2")
    with contextlib.ExitStack() as stack:
        prefill, *decodes = (server.url for server in stack.enter_context(tandem_servers(
            served(llama_folder, *kv_role("prefill"), *tp2),
            served(llama_folder, *kv_role("decode"), *tp2),
            served(llama_folder, *kv_role("decode")),
        )))  # fmt: skip
        router = stack.enter_context(
            tandem_process("router", "--prefill", prefill, "--decode", *decodes)
        )
        for index, (name, prompt) in enumerate(prompts().items()):
            expected = complete(tiny_server, prompt, stream=False)
            stream = index % 2 == 1  # (the router alternates the decode instances)
            assert complete(router, prompt, stream) == expected, name
        assert all(metric(d, "kv_transfer_blocks_total") > 0 for d in decodes)
        wait_for(lambda: idle(prefill))
        assert metric(prefill, "kv_lease_expiries_total") == 0
