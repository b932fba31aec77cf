"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers.Tokenizer``.

A GGUF file has no tokenizer.json: it stores the vocabulary (``tokenizer.ggml.tokens``,
``scores``, ``token_type``), the BPE merges, the special token ids and the chat
template as metadata. The model type says how they were meant to be used:

    gpt2    byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): tokens spelled in GPT-2's
            byte alphabet, merges in the file, a split regex per ``tokenizer.ggml.pre``
    llama   SentencePiece BPE (Llama 2, Mistral): "▁" for spaces, byte fallback
            tokens <0xNN>, merges in the file or recovered from the scores.
            Gemma's differs: no prefix space, runs of spaces stored as spaces (spelled
            "▁" here, as its tokenizer looks them up), and merges ranked by the
            tokens' order in the file, which its scores do not follow.

The result encodes as transformers' GGUF tokenizer does (the tests compare them on
multilingual and code text): the same models, pre-tokenizers and decoders, control
tokens (type 3) added as special tokens and user-defined ones (type 4) as added
tokens, so they are matched whole in text.
"""

from __future__ import annotations

from itertools import groupby
from operator import itemgetter
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tandem.errors import ModelLoadError

CONTROL, USER_DEFINED = 3, 4

# Split regexes of the byte-level vocabularies whose merges were learned on other
# pieces than GPT-2's default (``tokenizer.ggml.pre``).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss, Llama 4): words cut at case changes, contractions kept on the word,
# digits in threes, "/" and line ends kept on punctuation (its tokenizer.json's).
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "lfm2": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "gpt-4o": _O200K,
    "llama4": _O200K,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece vocabularies store scores, not merges: every way to cut a token
    into two tokens of the vocabulary is a merge, ranked by the token's score (higher
    first), then by the left and right pieces' lengths (longer first); equal keys keep
    the order of ``scores``.

    The order is built without sorting every merge (half a million for Gemma's
    vocabulary; docs/lab-notes/real-size-files.md, "A tokenizer of 262,144
    SentencePiece pieces"): the tokens are sorted by score, and the cuts of one token
    never tie (their left pieces differ in length), so a token whose score no other
    token has gives its cuts longest left piece first, and only tokens that share a
    score are sorted together."""
    by_score = sorted(scores.items(), key=itemgetter(1), reverse=True)
    merges: list[tuple[str, str]] = []
    for _, same_score in groupby(by_score, key=itemgetter(1)):
        tokens = [token for token, _ in same_score]
        cuts = [
            (token[:i], token[i:])
            for token in tokens
            for i in range(len(token) - 1, 0, -1)
            if token[:i] in vocab and token[i:] in vocab
        ]
        if len(tokens) > 1:
            cuts.sort(key=lambda cut: (len(cut[0]), len(cut[1])), reverse=True)
        merges.extend(cuts)
    return merges


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> HFTokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = SPLIT_REGEX.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(
    tokens: list[str], merges: list[str] | None, scores: list[float], gemma: bool = False
) -> HFTokenizer:
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(index) for index in range(len(tokens))]
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    spaces = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.decoder = decoders.Sequence(spaces)
        return tok
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    )
    tok.decoder = decoders.Sequence([*spaces, decoders.Strip(content=" ", left=1)])
    return tok


def build_tokenizer(value: Any) -> tuple[HFTokenizer, dict[str, str | None], bool, str | None]:
    """``value(key, default)`` reads the file's metadata. Returns the tokenizer, the
    special tokens (bos/eos/unk/pad text), whether to add BOS, and the chat template."""
    kind = value("tokenizer.ggml.model")
    tokens = value("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("the GGUF file has no tokenizer.ggml.tokens")
    types = value("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        tok = _byte_level(tokens, value("tokenizer.ggml.merges") or [], value("tokenizer.ggml.pre"))
        alphabet = set(byte_alphabet().values())
        add_bos_default = False
    elif kind == "llama":
        scores = value("tokenizer.ggml.scores") or [0.0] * len(tokens)
        gemma = str(value("general.architecture", "")).startswith("gemma")
        tok = _sentencepiece(tokens, value("tokenizer.ggml.merges"), scores, gemma)
        alphabet = None
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    else:
        raise ModelLoadError(
            f"GGUF tokenizer type {kind!r} is not supported (supported: gpt2, llama)"
        )
    # Control tokens whole, as special tokens. A byte-level "control" token spelled
    # outside the byte alphabet is a converter mislabel; adding it would grow the
    # vocabulary past the model's.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind_of in zip(tokens, types, strict=False)
        if kind_of == CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    tok.add_special_tokens(control)
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind_of in zip(tokens, types, strict=False)
        if kind_of == USER_DEFINED and tok.token_to_id(token) is not None
    ]
    tok.add_tokens(user)

    def token_text(key: str) -> str | None:
        index = value(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {
        "bos_token": token_text("bos_token_id"),
        "eos_token": token_text("eos_token_id"),
        "unk_token": token_text("unknown_token_id"),
        "pad_token": token_text("padding_token_id"),
    }
    add_bos = bool(value("tokenizer.ggml.add_bos_token", add_bos_default))
    return tok, special, add_bos, value("tokenizer.chat_template")
