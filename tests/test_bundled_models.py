"""The models shipped in models/: they load in transformers with the same logits, are
the default, and the target predicts held-out code better than the draft, which beats
a unigram model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from tandem import LLM, SamplingParams
from tandem.models import catalog
from tandem.models.catalog import (
    DEFAULT_DRAFT_MODEL,
    DEFAULT_MODEL,
    default_model,
    is_installed,
    resolve_model,
)
from tandem.models.loader import load_model
from tandem.runner.model_runner import ModelRunner, SequenceChunk, forward_no_cache
from tandem.train.corpus import split, stdlib_root, stdlib_sources
from tests.hf_models import assert_close, reference_logits

TEXTS = ["import os\n", "def fibonacci(n):\n    if n < 2:", "class Path:\n    def __init__(self"]


@pytest.mark.parametrize("folder", [DEFAULT_MODEL, DEFAULT_DRAFT_MODEL], ids=["target", "draft"])
def test_transformers_loads_it_with_the_same_logits(folder):
    loaded = load_model(folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = [loaded.tokenizer.encode(text) for text in TEXTS]
    assert batch == [hf_tokenizer(text)["input_ids"] for text in TEXTS]
    runner = ModelRunner(loaded, num_blocks=16, block_size=16)
    tables = [[i] for i in range(len(batch))]
    logits = runner.forward(
        [SequenceChunk(ids, 0, t) for ids, t in zip(batch, tables, strict=True)], all_logits=True
    )
    start = 0
    for ids in batch:
        assert_close(logits[start : start + len(ids)], reference_logits(hf_model, ids))
        start += len(ids)


def test_it_is_the_default_model_unless_a_real_one_is_installed(monkeypatch):
    """SmolLM2 when its package is installed (the README's commands install it), the
    bundled model otherwise; both by name too."""
    expected = "smollm2-135m-instruct" if is_installed("smollm2-135m-instruct") else None
    assert default_model() == (expected or str(DEFAULT_MODEL))
    monkeypatch.setattr(catalog, "is_installed", lambda name: False)
    assert default_model() == str(DEFAULT_MODEL)
    llm = LLM()
    assert llm.engine.config.model == str(DEFAULT_MODEL)
    assert resolve_model("stdlib-lm") == DEFAULT_MODEL
    out = llm.generate("import os\n", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_default_sampling_is_the_folders_generation_config_as_transformers_reads_it():
    llm = LLM("stdlib-lm")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL).eval()
    prompts = ["import os", "def fibonacci(n):"]
    # generate() with no params uses the folder's generation_config.json, as
    # transformers' generate() does: greedy with a repetition penalty over the
    # prompt and the output (the penalty changes the text, so it is really applied).
    outputs = llm.generate(prompts, use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            expected = hf_model.generate(ids, max_new_tokens=16, min_new_tokens=16)
        assert output.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()


def test_target_beats_draft_beats_unigram_on_heldout_code():
    target, draft = load_model(DEFAULT_MODEL), load_model(DEFAULT_DRAFT_MODEL)
    _, heldout = split(stdlib_sources(stdlib_root()))
    ids: list[int] = []
    for source in heldout:
        ids += [*target.tokenizer.encode(source.text), target.tokenizer.eos_token_id]
        if len(ids) > 4 * 512:
            break
    tokens = torch.tensor(ids[: 4 * 512 + 1])
    inputs, targets = tokens[:-1].view(4, 512), tokens[1:].view(4, 512)

    def loss(loaded) -> float:
        with torch.no_grad():
            logits = forward_no_cache(loaded, inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()

    # A unigram fitted on this very text: a lower (harder) bar than one fitted on train.
    counts = torch.bincount(targets.flatten(), minlength=target.config.vocab_size).double()
    probs = counts / counts.sum()
    unigram = -(probs[probs > 0] * probs[probs > 0].log()).sum().item()
    target_loss, draft_loss = loss(target), loss(draft)
    assert target_loss < draft_loss < unigram
