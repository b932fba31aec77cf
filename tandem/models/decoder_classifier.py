"""A decoder read as a classifier (a reranker): scores from the last token's final
hidden state, where a causal LM's next-token logits would come from. What config.json
says (after --hf-overrides):

    XForSequenceClassification   Hugging Face's head: ``score`` [labels, hidden] over
                                 the decoder X (the family of XForCausalLM); the file
                                 has no LM head, and the model makes scores, not text
    classifier_from_token        vLLM's key: these tokens' logits are the labels; two
                                 of them (["no", "yes"]) make one label, logit(yes) -
                                 logit(no), whose sigmoid is their softmax's "yes"
                                 (Qwen3-Reranker, scored as its model card does)
    is_original_qwen3_reranker   a (query, document) pair is written in its prompt
                                 (QWEN3_RERANKER_PAIR), not joined by the tokenizer

A causal-LM folder (or Hub id) whose name holds "Qwen3-Reranker" gets the last two
without being told (vLLM asks for them in --hf-overrides).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from tandem.errors import ModelLoadError

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"
QWEN3_RERANKER_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
QWEN3_RERANKER_PAIR = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@dataclass(frozen=True)
class DecoderClassifier:
    num_labels: int
    from_tokens: tuple[str, ...] = ()  # classifier_from_token (empty: a score head)
    pair_template: str | None = None  # with {query} and {document}


def with_name_defaults(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """config.json with what a Qwen3-Reranker's name implies (when it says nothing)."""
    causal = [arch.endswith("ForCausalLM") for arch in raw.get("architectures") or []] == [True]
    if causal and "qwen3-reranker" in name.lower() and "classifier_from_token" not in raw:
        return {**raw, "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    return raw


def causal_names(name: str) -> list[str]:
    """The architecture names to look a family up by: XForSequenceClassification
    after itself as XForCausalLM."""
    if name.endswith(SEQUENCE_CLASSIFICATION):
        return [name, name.removesuffix(SEQUENCE_CLASSIFICATION) + "ForCausalLM"]
    return [name]


def classifier_of(raw: dict[str, Any], encoder: bool) -> DecoderClassifier | None:
    """How a decoder's config asks to be read as a classifier (None: it is not)."""
    if encoder:
        return None  # (encoders have their own heads: models/bert.py)
    tokens = raw.get("classifier_from_token")
    template = QWEN3_RERANKER_PAIR if raw.get("is_original_qwen3_reranker") else None
    if tokens:
        if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
            raise ModelLoadError("classifier_from_token must be a list of token texts")
        return DecoderClassifier(1 if len(tokens) == 2 else len(tokens), tuple(tokens), template)
    names = raw.get("architectures") or []
    if any(name.endswith(SEQUENCE_CLASSIFICATION) for name in names):
        labels = len(raw["id2label"]) if raw.get("id2label") else raw.get("num_labels", 2)
        return DecoderClassifier(int(labels), (), template)
    return None


def add_score_head(model: torch.nn.Module, classifier: DecoderClassifier) -> None:
    """Before loading (on the meta device): the ``score`` layer a sequence-
    classification file fills, and its LM head pointed at the embedding (the file
    has none; the model is refused text: RunnerInfo.generates)."""
    from tandem.models.linear import Linear

    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is None or not hasattr(model, "lm_head"):
        raise ModelLoadError(f"{type(model).__name__} cannot be read as a sequence classifier")
    model.score = Linear(model.config.hidden_size, classifier.num_labels, bias=False)
    model.lm_head.weight = embed.weight


def attach(model: torch.nn.Module, classifier: DecoderClassifier, tokenizer: Any) -> None:
    """After loading: ``model.classify`` (the last token's rows [N, hidden] -> float32
    scores [N, labels]), ``num_labels``, and whether it still generates."""
    if classifier.from_tokens:
        if tokenizer is None:
            raise ModelLoadError("classifier_from_token needs the model's tokenizer")
        ids = []
        for text in classifier.from_tokens:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ModelLoadError(f"classifier_from_token {text!r} is not one token")
            ids.append(encoded[0])

        def classify(self, rows: torch.Tensor) -> torch.Tensor:
            logits = self.compute_logits(rows)[:, ids]
            return logits[:, 1:] - logits[:, :1] if len(ids) == 2 else logits

        model.generates = True
    else:

        def classify(self, rows: torch.Tensor) -> torch.Tensor:
            return self.score(rows).float()

        model.generates = False
    model.classify = types.MethodType(classify, model)
    model.num_labels = classifier.num_labels
    if classifier.pair_template is not None and tokenizer is not None:
        template = classifier.pair_template.replace("{instruction}", QWEN3_RERANKER_INSTRUCTION)
        tokenizer.pair_template = template
