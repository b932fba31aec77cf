"""Embeddings (SamplingParams.pooling, LLM.embed / LLM.score, /v1/embeddings,
/v1/score, /v1/rerank): each vector against transformers' hidden states and against
sentence-transformers on the same weights; embedding requests batched with generation
change neither; OpenAI's SDK against a real server, bad input a 400 naming the field."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError
from tandem.executor import make_executor
from tandem.sampling import PoolingParams
from tandem.server.api import build_app
from tandem.serving.async_engine import AsyncEngine
from tests.servers import thread_server

TEXTS = ["The KV cache holds keys and values.", "Paris is in France.", "a", "Tokens " * 40]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, model_dirs):
    folder = model_dirs(request.param)[0]
    return folder, LLM(str(folder), max_num_batched_tokens=64)  # long prompts: chunked


def _reference(folder, token_ids: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).last_hidden_state[0]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_each_pooling_equals_transformers_hidden_states(model, pooling):
    folder, llm = model
    for output in llm.embed(TEXTS, PoolingParams(pooling), use_tqdm=False):
        hidden = _reference(folder, output.prompt_token_ids)
        row = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
        expected = torch.nn.functional.normalize(row, dim=0)
        torch.testing.assert_close(torch.tensor(output.embedding), expected, atol=2e-5, rtol=0)


def test_dimensions_cut_before_normalising_and_raw_vectors(model):
    folder, llm = model
    cut, raw = (llm.embed(TEXTS[:1], p, use_tqdm=False)[0]
                for p in (PoolingParams(dimensions=8), PoolingParams(normalize=False)))  # fmt: skip
    hidden = _reference(folder, cut.prompt_token_ids)[-1]
    torch.testing.assert_close(torch.tensor(raw.embedding), hidden, atol=2e-5, rtol=1e-5)
    expected = torch.nn.functional.normalize(hidden[:8], dim=0)
    torch.testing.assert_close(torch.tensor(cut.embedding), expected, atol=2e-5, rtol=0)


def _st_modules():
    """sentence-transformers' Transformer, Pooling and Normalize (moved in 6.x)."""
    try:
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    return modules.Transformer, modules.Pooling, modules.Normalize


def test_sentence_transformers_on_the_same_weights(model, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    transformer, pooler, normalize = _st_modules()
    folder, llm = model
    # The same weights without a chat template: sentence-transformers 6 wraps a text in
    # the template when the tokenizer has one (an embedding of the text is asked here).
    for path in folder.iterdir():
        if path.name != "chat_template.jinja":
            shutil.copy(path, tmp_path / path.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for mode, pooling in (("lasttoken", "last"), ("mean", "mean")):
        modules = [transformer(str(tmp_path)),
                   pooler(llm.engine.model_info.hidden_size, mode), normalize()]  # fmt: skip
        theirs = st.SentenceTransformer(modules=modules, device="cpu")
        theirs.tokenizer.pad_token = theirs.tokenizer.eos_token  # (a batch of one: unused)
        for text in TEXTS[:3]:  # one at a time: the tiny tokenizer has no padding token
            expected = theirs.encode([text], convert_to_numpy=True)[0]
            mine = llm.embed(text, PoolingParams(pooling), use_tqdm=False)[0].embedding
            np.testing.assert_allclose(mine, expected, atol=2e-5)


def test_a_sentence_transformers_folder_says_how_it_is_read(model_dirs, tmp_path):
    folder = model_dirs("llama")[0]
    for path in folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    kind = "sentence_transformers.models."
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": kind + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": kind + "Pooling"},
    ]))  # fmt: skip
    (tmp_path / "1_Pooling").mkdir()
    mean = json.dumps({"pooling_mode_mean_tokens": True})
    (tmp_path / "1_Pooling" / "config.json").write_text(mean)
    llm = LLM(str(tmp_path))
    default = llm.embed(TEXTS[0], use_tqdm=False)[0].embedding  # mean, not normalised
    explicit = llm.embed(TEXTS[0], PoolingParams("mean", normalize=False), use_tqdm=False)[0]
    assert default == explicit.embedding and abs(np.linalg.norm(default) - 1) > 1e-3


def test_embeddings_batched_with_generation_change_neither(model_dirs):
    folder = str(model_dirs("llama")[0])
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone_llm = LLM(folder)
    alone = [o.outputs[0].token_ids for o in alone_llm.generate(TEXTS, greedy, use_tqdm=False)]
    vectors = [o.embedding for o in alone_llm.embed(TEXTS, use_tqdm=False)]
    mixed = LLM(folder, max_num_batched_tokens=48)
    engine = mixed.engine
    for i, text in enumerate(TEXTS):
        engine.add(engine.input_processor.process(f"g{i}", text, greedy))
        pooled = SamplingParams(max_tokens=1, pooling=PoolingParams())
        engine.add(engine.input_processor.process(f"e{i}", text, pooled))
    finished, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        mixed_steps += any(o.request_id.startswith("e") for o in outputs) and any(
            o.request_id.startswith("g") for o in outputs)  # fmt: skip
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert mixed_steps > 0  # embeddings finished in steps that also generated
    assert [finished[f"g{i}"].outputs[0].token_ids for i in range(len(TEXTS))] == alone
    for i, vector in enumerate(vectors):
        np.testing.assert_allclose(finished[f"e{i}"].pooled, vector, atol=1e-5)


def test_score_is_the_cosine_of_the_embeddings(model):
    _, llm = model
    first, *others = (np.array(o.embedding) for o in llm.embed(TEXTS, use_tqdm=False))
    scores = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    np.testing.assert_allclose(scores, [first @ o for o in others], atol=1e-6)


def test_dimensions_beyond_the_model_are_refused_before_queueing(model):
    _, llm = model
    with pytest.raises(InvalidParameterError) as refused:
        llm.embed("x", PoolingParams(dimensions=10_000), use_tqdm=False)
    assert refused.value.param == "dimensions" and not llm.engine.has_unfinished_requests()


# -- a real server, OpenAI's SDK --------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dirs):
    config = EngineConfig.from_kwargs(str(model_dirs("llama")[0]))
    engine = AsyncEngine(Engine(config, make_executor(config)))
    try:
        with thread_server(build_app(engine, "m")) as url:
            yield url, LLM(str(model_dirs("llama")[0]))
    finally:
        engine.shutdown()


def test_the_sdk_gets_embeddings_as_floats_and_as_base64(server):
    url, llm = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    expected = [o.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    floats = client.embeddings.create(model="m", input=TEXTS)
    got = [d.embedding for d in sorted(floats.data, key=lambda d: d.index)]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    packed = client.embeddings.create(model="m", input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in packed.data]
    np.testing.assert_allclose(decoded, expected, atol=1e-6)  # little-endian float32
    tokens = sum(len(o.prompt_token_ids) for o in llm.embed(TEXTS, use_tqdm=False))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    ids = llm.embed(TEXTS[1], use_tqdm=False)[0].prompt_token_ids
    by_ids = client.embeddings.create(model="m", input=[ids], dimensions=16)
    assert len(by_ids.data[0].embedding) == 16


def test_rerank_and_score_in_their_shapes(server):
    url, llm = server
    documents = TEXTS[1:]
    expected = llm.score(TEXTS[0], documents, use_tqdm=False)
    ranked = httpx.post(f"{url}/v1/rerank", json={
        "model": "m", "query": TEXTS[0], "documents": documents, "top_n": 2}).json()  # fmt: skip
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(expected)[::-1][:2])
    assert ranked["results"][0]["document"]["text"] == documents[ranked["results"][0]["index"]]
    assert httpx.post(f"{url}/rerank", json={"query": "a", "documents": ["b"]}).status_code == 200
    scored = httpx.post(f"{url}/v1/score", json={"text_1": TEXTS[0], "text_2": documents})
    np.testing.assert_allclose([d["score"] for d in scored.json()["data"]], expected, atol=1e-6)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["ok", ""]}, "input[1]"),
        ("/v1/embeddings", {"input": "x", "dimensions": 10_000}, "dimensions"),
        ("/v1/embeddings", {"input": ["x"] * 100_000}, "input"),
        ("/v1/embeddings", {"input": [[10**9]]}, "prompt"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["d"] * 100_000}, "documents"),
        ("/v1/score", {"text_1": "q", "text_2": ["d"] * 100_000}, "text_2"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server[0]}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
