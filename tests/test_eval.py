"""`tandem eval` against direct computations: perplexity equals exp of the mean NLL
transformers gives on the same windows (llama.cpp's windowing: BOS first, the second
half scored); KL divergence of a model against itself is 0, and against a known
perturbation of its own distributions the exact value."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.eval.run import evaluate, reference_log_probs, text_tokens
from tandem.eval.windows import windows

CTX = 32
TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache keeps each sequence "
    "in fixed-size blocks, and the scheduler hands out a token budget every step. "
) * 12


@pytest.fixture(scope="module")
def setup(model_dirs, tmp_path_factory):
    folder, hf_model = model_dirs("llama")
    text = tmp_path_factory.mktemp("eval") / "text.txt"
    text.write_text(TEXT)
    llm = LLM(str(folder), enable_prefix_caching=False)
    return folder, hf_model, text, llm


def test_perplexity_is_exp_of_the_mean_nll_transformers_gives(setup):
    _, hf_model, text, llm = setup
    tokens = text_tokens(llm, text)
    figures = evaluate(llm, tokens, CTX, None, progress=False)
    tokenizer = llm.get_tokenizer()
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None  # as llama.cpp decides
    nll = []
    for window in windows(tokens, CTX, bos):
        with torch.no_grad():
            logits = hf_model(torch.tensor([window])).logits[0].double()
        log_probs = logits.log_softmax(dim=-1)
        for position in range(CTX // 2, CTX - 1):
            nll.append(-log_probs[position, window[position + 1]].item())
    assert figures["tokens"] == len(nll) == (len(tokens) // CTX) * (CTX // 2 - 1)
    assert figures["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


def test_a_model_against_itself_diverges_by_nothing(setup):
    _, _, text, llm = setup
    tokens = text_tokens(llm, text)
    reference = reference_log_probs(llm, tokens, CTX, progress=False)
    figures = evaluate(llm, tokens, CTX, reference, progress=False)
    assert figures["kld_mean"] == pytest.approx(0, abs=1e-6)
    assert figures["same_top_pct"] == 100
    assert figures["perplexity_ratio"] == pytest.approx(1, abs=1e-3)


def test_a_known_perturbation_gives_the_exact_divergence(setup):
    """The reference: the model's own distributions at temperature 2. Expected values
    straight from torch's kl_div, argmax and exp."""
    _, _, text, llm = setup
    tokens = text_tokens(llm, text)
    own = reference_log_probs(llm, tokens, CTX, progress=False)
    hot = [(lp / 2).log_softmax(dim=-1) for lp in own["log_probs"]]
    reference = {**own, "log_probs": hot}
    figures = evaluate(llm, tokens, CTX, reference, progress=False)
    model = torch.cat(own["log_probs"]).double()
    ref = torch.cat(hot).double()
    kld = F.kl_div(model, ref, log_target=True, reduction="none").sum(dim=-1)
    assert figures["kld_mean"] == pytest.approx(kld.mean().item(), rel=2e-3)
    assert figures["kld_max"] == pytest.approx(kld.max().item(), rel=2e-3)
    assert figures["same_top_pct"] == 100  # the temperature keeps the order
    targets = torch.cat([torch.tensor(w[CTX // 2 + 1 :]) for w in windows(tokens, CTX, 0)])
    nll = -model.gather(1, targets[:, None]).squeeze(1)
    nll_ref = -ref.gather(1, targets[:, None]).squeeze(1)
    ratio = math.exp((nll.mean() - nll_ref.mean()).item())
    assert figures["perplexity_ratio"] == pytest.approx(ratio, rel=1e-3)
    p_diff = (-nll).exp() - (-nll_ref).exp()
    assert figures["delta_p_rms_pct"] == pytest.approx(
        100 * p_diff.square().mean().sqrt().item(), rel=1e-2
    )


def test_the_command_saves_and_reuses_the_reference(setup, tmp_path):
    folder, _, text, _ = setup
    saved = tmp_path / "reference.pt"

    def cli(*args):
        result = subprocess.run(
            [sys.executable, "-m", "tandem", "eval", *args, "--model", str(folder),
             "--text", str(text), "--ctx", str(CTX), "--json", "--no-progress"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    first = cli("kld", "--reference", str(folder), "--save-reference", str(saved))
    again = cli("kld", "--reference-file", str(saved))
    assert first == again and first["same_top_pct"] == 100
    assert cli("perplexity")["perplexity"] == pytest.approx(first["perplexity"])


def test_chunked_windows_score_as_whole_ones_and_show_the_kv_cache_dtype(setup, model_dirs):
    """Run in chunks, a window's scores are the whole window's (chunked prefill is
    exact); with an int8 KV cache they diverge a little, chunked or whole alike: every
    token attends to its context as the cache holds it."""
    folder, _, text, llm = setup
    tokens = text_tokens(llm, text)
    reference = reference_log_probs(llm, tokens, CTX, progress=False)
    chunked = evaluate(llm, tokens, CTX, reference, progress=False, batch=5)
    assert chunked["kld_mean"] == pytest.approx(0, abs=1e-6)
    int8 = LLM(str(folder), enable_prefix_caching=False, kv_cache_dtype="int8")
    whole = evaluate(int8, tokens, CTX, reference, progress=False)["kld_mean"]
    read_back = evaluate(int8, tokens, CTX, reference, progress=False, batch=4)["kld_mean"]
    # (a tiny random model's distributions are nearly flat: small, 8.1e-8, but well
    # above float's, whose chunked scores differ from whole ones only by rounding:
    # +-1e-8, either sign, moved by how the kernels were compiled and the threads)
    assert read_back > 4 * max(abs(chunked["kld_mean"]), 1e-9)
    # alike, not equal: ulp-level differences between the two paths can round an int8
    # value the other way
    assert whole == pytest.approx(read_back, rel=0.25)


def test_scoring_borrows_blocks_and_leaves_the_prefix_cache_honest(setup):
    """On an engine with prefix caching, the windows take their blocks from the pool
    (evicting what those cached); a cached prompt then still generates as before. Three
    blocks: the prompt's cached first block survives, its second is evicted."""
    folder, _, text, _ = setup
    llm = LLM(str(folder), num_blocks=3, block_size=16)  # prefix caching on
    prompt = {"prompt_token_ids": list(range(5, 45))}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    evaluate(llm, text_tokens(llm, text), CTX, None, progress=False)
    llm.engine.kv_manager.check_no_leaks()
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == before
