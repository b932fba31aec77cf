"""Tokenizer and chat template against transformers on the same folder."""

from __future__ import annotations

import json

import pytest
import transformers

from tandem.errors import InvalidParameterError
from tandem.models.tokenizer import Tokenizer

TEXTS = ["The quick brown fox", "naïve café 東京 ✓", "", "def f(x):\n    return x"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is paged attention?"},
    {"role": "assistant", "content": "KV in blocks."},
    {"role": "user", "content": "And prefill?"},
]


@pytest.fixture(scope="module")
def folders(model_dirs):
    folder, _ = model_dirs("llama")
    return folder, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(folders, text):
    folder, reference = folders
    ours = Tokenizer(folder)
    assert ours.encode(text) == reference(text)["input_ids"]
    assert (
        ours.encode(text, add_special_tokens=False)
        == reference(text, add_special_tokens=False)["input_ids"]
    )
    ids = reference(text)["input_ids"]
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens(folders):
    folder, reference = folders
    ours = Tokenizer(folder)
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_id == reference.eos_token_id


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(folders, add_generation_prompt):
    folder, reference = folders
    ours = Tokenizer(folder)
    expected = reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt) == (
        expected
    )
    expected_ids = reference.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    if not isinstance(expected_ids, list):  # transformers 5 returns a BatchEncoding
        expected_ids = expected_ids["input_ids"]
    assert ours.encode_chat(CONVERSATION) == expected_ids


@pytest.mark.parametrize("final", ["KV in", "  spaced  ", "ends with a space "])
def test_continue_final_message_matches_transformers(folders, final):
    """Assistant prefill: the text stops where the last message's content does."""
    folder, reference = folders
    conversation = [*CONVERSATION, {"role": "assistant", "content": final}]
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ours = Tokenizer(folder).apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == expected
    with pytest.raises(InvalidParameterError, match="continue_final_message"):
        Tokenizer(folder).apply_chat_template(conversation, continue_final_message=True)


def test_chat_template_from_tokenizer_config(tmp_path, folders):
    """Older checkpoints keep the template inside tokenizer_config.json."""
    folder, _ = folders
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | tojson }}{% endfor %}"
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    text = Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "café"}])
    assert text == '[user] "café"'


def test_template_raise_exception_is_a_clear_error(tmp_path, folders):
    folder, _ = folders
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    config = {"chat_template": "{{ raise_exception('roles must alternate') }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidParameterError, match="roles must alternate") as refused:
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    assert refused.value.param == "messages"  # the request's fault: a 400, not a 500


def test_a_tool_call_turn_renders_in_a_template_without_tools(tmp_path, folders):
    """An assistant turn of tool calls has content None; a template that concatenates
    content as text (SmolLM2's) once made that a 500."""
    folder, _ = folders
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}<{{ m['role'] }}>{{ '' + m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    text = Tokenizer(tmp_path).apply_chat_template(turns, add_generation_prompt=False)
    assert text == "<user>Weather?<assistant><tool>sunny"
    broken = "{{ messages[0]['content'] + 1 }}"  # fails whatever the content
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": broken}))
    with pytest.raises(InvalidParameterError, match="cannot render"):
        Tokenizer(tmp_path).apply_chat_template(turns)


def test_merges_from_scores_follow_their_definition_with_tied_scores():
    """SentencePiece merges recovered from scores, against the definition written out:
    every cut of a token into two vocabulary tokens, sorted by (score, left length,
    right length), highest first, ties in the order of the scores; random vocabularies
    of a 3-letter alphabet, so that scores and cut lengths tie often."""
    import random

    from tandem.models.gguf_tokenizer import merges_from_scores

    rng = random.Random(0)
    for _ in range(100):
        words = ("".join(rng.choices("abc", k=rng.randint(1, 6))) for _ in range(60))
        vocab = {token: i for i, token in enumerate(dict.fromkeys(words))}
        order = rng.sample(list(vocab), len(vocab))
        scores = {token: float(rng.randint(0, 4)) for token in order}
        cuts = [
            (token[:i], token[i:], score, rank)
            for rank, (token, score) in enumerate(scores.items())
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        cuts.sort(key=lambda c: (-c[2], -len(c[0]), -len(c[1]), c[3]))
        assert merges_from_scores(vocab, scores) == [(left, right) for left, right, *_ in cuts]
