"""Decoders read as classifiers (models/decoder_classifier.py): a Hugging Face
XForSequenceClassification's scores equal transformers' logits at the last token,
chunked and batched, and it refuses to generate; a Qwen3-Reranker (a causal LM whose
score is softmax(logit(no), logit(yes))[yes] over the model card's prompt) scores
(query, document) pairs as transformers' causal LM does on the same text, found by its
name or told by vLLM's --hf-overrides; bad overrides are refused naming the field."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.errors import InvalidParameterError, ModelLoadError
from tandem.executor import make_executor
from tandem.sampling import PoolingParams
from tandem.server.api import build_app
from tandem.serving.async_engine import AsyncEngine
from tests.hf_models import build_tokenizer, hf_config
from tests.servers import thread_server
from tests.test_encoders import DOCUMENTS, QUERY, TEXTS

transformers = pytest.importorskip("transformers")

# The prompt of Qwen3-Reranker's model card, written out here (the reference).
CARD_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _save(folder, model, tokenizer) -> None:
    with torch.no_grad():  # (norms at 1, biases at 0 would hide a skipped tensor)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def sequence_classifiers(tmp_path_factory):
    """(arch, labels) -> (folder, transformers model)."""
    built = {}

    def get(arch: str, num_labels: int):
        if (arch, num_labels) not in built:
            torch.manual_seed(num_labels)
            folder = tmp_path_factory.mktemp(f"{arch}-classifier-{num_labels}")
            config = hf_config(arch, num_labels=num_labels, pad_token_id=2)
            model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
            _save(folder, model, build_tokenizer())
            built[arch, num_labels] = folder, model
        return built[arch, num_labels]

    return get


@pytest.mark.parametrize(("arch", "num_labels"), [("qwen3", 1), ("llama", 3), ("qwen2", 2)])
def test_sequence_classification_equals_transformers_at_the_last_token(
    sequence_classifiers, arch, num_labels
):
    folder, hf = sequence_classifiers(arch, num_labels)
    assert json.loads((folder / "config.json").read_text())["architectures"][0].endswith(
        "ForSequenceClassification"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder), max_num_batched_tokens=32)  # the longest prompt runs in chunks
    got = llm.embed(TEXTS, PoolingParams("classify", normalize=False), use_tqdm=False)
    for text, output in zip(TEXTS, got, strict=True):
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = hf(ids).logits[0]
        assert output.prompt_token_ids == ids[0].tolist()
        torch.testing.assert_close(torch.tensor(output.embedding), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidParameterError) as refused:
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert refused.value.param == "model"


def test_a_sequence_classifier_scores_pairs_as_the_tokenizer_joins_them(sequence_classifiers):
    folder, hf = sequence_classifiers("qwen3", 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    scores = LLM(str(folder)).score(QUERY, DOCUMENTS, use_tqdm=False)
    for document, score in zip(DOCUMENTS, scores, strict=True):
        ids = tokenizer(QUERY, document, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = torch.sigmoid(hf(ids).logits[0, 0]).item()
        assert score == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A random Qwen3 causal LM in a folder named as Qwen3-Reranker, whose tokenizer
    writes "yes" and "no" as one token each; and transformers' model of it."""
    folder = tmp_path_factory.mktemp("x") / "Qwen3-Reranker-tiny"
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(hf_config("qwen3")).eval()
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["yes", "no"])
    _save(folder, model, tokenizer)
    return folder, model, transformers.AutoTokenizer.from_pretrained(folder)


def _card_scores(reranker) -> list[float]:
    """softmax(logit(no), logit(yes))[yes] at the last token of the card's prompt."""
    _, model, tokenizer = reranker
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    scores = []
    for document in DOCUMENTS:
        body = f"<Instruct>: {CARD_INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {document}"
        text = CARD_PREFIX + body + CARD_SUFFIX
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            last = model(ids).logits[0, -1]
        scores.append(torch.softmax(last[[no, yes]], dim=0)[1].item())
    return scores


def test_a_qwen3_reranker_is_found_by_its_name_and_scores_as_its_card(reranker):
    folder = reranker[0]
    expected = _card_scores(reranker)
    scores = LLM(str(folder)).score(QUERY, DOCUMENTS, use_tqdm=False)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == len(scores)  # (not one constant)


def test_a_reranker_under_another_name_is_told_by_hf_overrides(reranker, tmp_path):
    renamed = tmp_path / "my-reranker"
    shutil.copytree(reranker[0], renamed)
    plain = LLM(str(renamed))
    assert not plain.engine.model_info.num_labels  # a causal LM: it generates
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }  # vLLM's documented overrides for Qwen3-Reranker
    scores = LLM(str(renamed), hf_overrides=json.dumps(overrides)).score(
        QUERY, DOCUMENTS, use_tqdm=False
    )
    assert scores == pytest.approx(_card_scores(reranker), abs=1e-5)


def test_bad_overrides_are_refused_naming_the_field(reranker):
    with pytest.raises(InvalidParameterError) as refused:
        EngineConfig.from_kwargs("m", hf_overrides="{not json")
    assert refused.value.param == "hf_overrides"
    with pytest.raises(InvalidParameterError):
        EngineConfig.from_kwargs("m", hf_overrides="[1, 2]")
    with pytest.raises(ModelLoadError, match="not one token"):
        LLM(str(reranker[0]), hf_overrides={"classifier_from_token": ["no", "maybe"]})


def test_a_server_reranks_with_the_reranker_and_refuses_text_from_a_score_head(
    reranker, sequence_classifiers
):
    engines = []

    def app(folder):
        config = EngineConfig.from_kwargs(str(folder))
        engines.append(AsyncEngine(Engine(config, make_executor(config))))
        return build_app(engines[-1], "m")

    try:
        with thread_server(app(reranker[0])) as ranking, thread_server(
            app(sequence_classifiers("qwen3", 1)[0])
        ) as scoring:  # fmt: skip
            body = {"query": QUERY, "documents": DOCUMENTS}
            ranked = httpx.post(f"{ranking}/v1/rerank", json=body).json()["results"]
            expected = _card_scores(reranker)
            assert [r["index"] for r in ranked] == sorted(
                range(len(expected)), key=lambda i: -expected[i]
            )
            got = [r["relevance_score"] for r in sorted(ranked, key=lambda r: r["index"])]
            assert got == pytest.approx(expected, abs=1e-5)
            chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
            refused = httpx.post(f"{scoring}/v1/chat/completions", json=chat)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    finally:
        for engine in engines:
            engine.shutdown()
