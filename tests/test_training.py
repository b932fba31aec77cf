"""Corpus, tokenizer and training loop on a tiny slice of the standard library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import transformers

from tandem.models.loader import load_model
from tandem.models.random_weights import random_model
from tandem.models.tokenizer import Tokenizer
from tandem.train.bpe import END_OF_TEXT, save_tokenizer, train_bpe
from tandem.train.corpus import is_heldout, split, stdlib_root, stdlib_sources
from tandem.train.trainer import TrainConfig, train

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 48,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def tiny_corpus():
    sources = stdlib_sources(stdlib_root() / "json")
    return [s.text for s in sources]


def test_corpus_is_found_split_and_deduplicated():
    sources = stdlib_sources(stdlib_root() / "json")
    assert sources and all(s.path.endswith(".py") for s in sources)
    assert len({s.text for s in sources}) == len(sources)
    train_files, heldout = split(sources, heldout_percent=50)
    assert len(train_files) + len(heldout) == len(sources)
    # The split depends on the path alone.
    assert all(is_heldout(s.path, 50) for s in heldout)
    assert not any(is_heldout(s.path, 50) for s in train_files)


def test_tokenizer_loads_in_tandem_and_transformers(tmp_path):
    tokenizer = train_bpe(tiny_corpus(), vocab_size=512)
    save_tokenizer(tokenizer, tmp_path, model_max_length=256)
    ours = Tokenizer(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "def dumps(obj, *, indent=None):\n    return 'ok'\n"
    assert ours.encode(text) == reference(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == text
    assert ours.eos_token_id == reference.eos_token_id == tokenizer.token_to_id(END_OF_TEXT)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == reference.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )


def test_loss_goes_down_and_resume_matches(tmp_path):
    tokenizer = train_bpe(tiny_corpus(), vocab_size=512)
    tokens = torch.tensor(tokenizer.encode("\n".join(tiny_corpus())).ids[:20000])
    config = TrainConfig(
        steps=40, batch_size=8, seq_len=64, lr=1e-2, warmup_steps=5, checkpoint_every=20
    )
    straight = random_model(TINY, dtype="float32", seed=0)
    losses = train(straight, tokens, config, progress=False)
    # From uniform over 512 tokens (ln 512 = 6.2 nats), at least half a nat learned.
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    # Interrupt after 20 steps, resume to 40: the same weights as one run.
    resumed = random_model(TINY, dtype="float32", seed=0)
    checkpoint = tmp_path / "checkpoint.pt"
    train(resumed, tokens, config, checkpoint, progress=False, stop_at=20)
    state = torch.load(checkpoint, weights_only=False)
    assert state["step"] == 20
    resumed_again = random_model(TINY, dtype="float32", seed=0)
    resumed_losses = train(resumed_again, tokens, config, checkpoint, progress=False)
    assert resumed_losses == losses
    for a, b in zip(straight.model.parameters(), resumed_again.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_training_script_runs_end_to_end(tmp_path):
    """The real script on one small stdlib package, a few steps per model. Of sqlite3's
    Python files the split holds out dump.py, 3.5 KB (json's held out more text than it
    trained on: its evaluation took 10 s of 27)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_bundled_models.py"
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            "--corpus-dir",
            str(stdlib_root() / "sqlite3"),
            "--heldout-percent",
            "40",
            "--vocab-size",
            "384",
            "--target-schedule",  # two segments: the second resumes the first
            "1,2",
            "--draft-schedule",
            "1",
            "--out",
            str(tmp_path / "models"),
            "--work-dir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("stdlib-lm", "stdlib-lm-draft"):
        folder = tmp_path / "models" / name
        card = (folder / "README.md").read_text()
        assert "held-out bits per byte" in card and "draft greedy agreement" in card
        loaded = load_model(folder)
        assert loaded.tokenizer.eos_token_id in loaded.eos_token_ids
