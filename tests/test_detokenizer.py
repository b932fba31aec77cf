"""Incremental detokenization against decoding everything at once."""

from __future__ import annotations

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.models.tokenizer import Tokenizer

TEXT = "Ça va? naïve café 東京 ✓ and the KV cache"


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    return Tokenizer(model_dirs("llama")[0])


def stream(tokenizer, ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"), **kwargs)
    shown = []
    for token in ids:
        stop = detok.update(token)
        shown.append(detok.visible_text(finished=False))
        if stop:
            break
    return detok, shown


def test_multibyte_characters_split_over_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Byte-level BPE splits the CJK characters: some prefix decodes to U+FFFD.
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    detok, shown = stream(tokenizer, ids)
    assert detok.text == TEXT
    assert all("\ufffd" not in text for text in shown)
    assert all(TEXT.startswith(text) for text in shown)


def test_stop_string_is_cut_and_prefixes_are_held_back(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, shown = stream(tokenizer, ids, stop=("東京",))
    assert detok.matched_stop == "東京"
    assert detok.text == "Ça va? naïve café "
    assert all(not text.endswith("東") for text in shown)


def test_held_back_text_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, shown = stream(tokenizer, ids, stop=("cache!",))
    assert detok.matched_stop is None
    assert shown[-1] == TEXT[: len(TEXT) - len("cache!") + 1]
    assert detok.visible_text(finished=True) == TEXT


def test_include_stop_string(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, _ = stream(tokenizer, ids, stop=("café",), include_stop_str_in_output=True)
    assert detok.text == "Ça va? naïve café"
