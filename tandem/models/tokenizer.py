"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, plus the special
tokens and chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``).

Chat templates are rendered the way transformers renders them: a sandboxed jinja2
environment with trim_blocks / lstrip_blocks, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, and the special tokens
passed as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from tandem.errors import InvalidParameterError, ModelLoadError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks; for rendering it is transparent."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    # A template refuses a conversation it cannot render (roles out of order...): the
    # request's fault, named as its messages.
    raise InvalidParameterError("messages", f"the chat template refuses them: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value: Any) -> str | None:
    # Special tokens are stored either as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    json_file = folder / "chat_template.json"
    if template is None and json_file.is_file():
        template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"cannot read tokenizer {path}: {exc}") from None
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"cannot parse {config_path}: {exc}") from None
        self._setup(
            backend,
            {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS},
            bool(config.get("add_bos_token", False)),
            _read_chat_template(folder, config),
        )

    @classmethod
    def from_parts(
        cls,
        backend: HFTokenizer,
        special_tokens: dict[str, str | None],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> Tokenizer:
        """A tokenizer built elsewhere (e.g. from a GGUF file's metadata)."""
        tokenizer = cls.__new__(cls)
        tokenizer._setup(backend, special_tokens, add_bos_token, chat_template)
        return tokenizer

    def _setup(
        self,
        backend: HFTokenizer,
        special_tokens: dict[str, str | None],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        # A file may pad or cut every encoding to a fixed length (sentence-transformers'
        # folders: 128); transformers turns both off unless a call asks, and so does
        # tandem (a prompt too long for the context is refused, never cut).
        backend.no_padding()
        backend.no_truncation()
        self._tok = backend
        self.special_tokens = {k: special_tokens.get(k) for k in SPECIAL_TOKEN_KEYS}
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        self.eos_token_id = self._id_of(self.special_tokens["eos_token"])
        self.add_bos_token = add_bos_token
        self.chat_template_source = chat_template
        self._chat_template: jinja2.Template | None = None
        # How a (query, document) pair is written, with {query} and {document}, for a
        # model that reads pairs in a prompt (models/decoder_classifier.py); None: the
        # tokenizer's own pair post-processing.
        self.pair_template: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the engine-core process sends its tokenizer to the server): the
        compiled chat template stays behind and is compiled again on first use."""
        return {**self.__dict__, "_chat_template": None}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer as its JSON (for the grammar engine)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some checkpoints ask for BOS in tokenizer_config.json but carry no
        # post-processor in tokenizer.json that adds it.
        wants_bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        if wants_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int | None]:
        """Two texts joined as the tokenizer's post-processor joins a pair (BERT:
        ``[CLS] a [SEP] b [SEP]``), and the index where the second one's tokens start
        (its token type 1), or None when the tokenizer does not tell them apart.
        With a ``pair_template``, the pair written in it (no token types)."""
        if self.pair_template is not None:
            text = self.pair_template.format(query=first, document=second)
            return self.encode(text, add_special_tokens=False), None
        encoding = self._tok.encode(first, second)
        second_at = next((i for i, t in enumerate(encoding.type_ids) if t), None)
        return encoding.ids, second_at

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers' apply_chat_template.
        ``continue_final_message``: the text ends where the last message's content does
        (no end-of-turn after it), so the model continues that message (assistant
        prefill)."""
        if self.chat_template_source is None:
            raise InvalidParameterError(
                "messages", "this model's tokenizer has no chat template (send a prompt instead)"
            )
        if continue_final_message and add_generation_prompt:
            raise InvalidParameterError(
                "continue_final_message", "cannot be combined with add_generation_prompt"
            )
        if self._chat_template is None:
            self._chat_template = _compile_template(self.chat_template_source)
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}

        def render(conversation: list[dict[str, Any]]) -> str:
            return self._chat_template.render(
                messages=conversation, add_generation_prompt=add_generation_prompt,
                **variables, **kwargs,
            )  # fmt: skip

        # An assistant turn of tool calls has no content (None, as transformers passes
        # it); a template written without tools concatenates it as text: then "" again.
        attempts = [messages]
        if any(m.get("content") is None for m in messages):
            attempts.append([{**m, "content": m.get("content") or ""} for m in messages])
        for attempt, conversation in enumerate(attempts, 1):
            try:
                text = render(conversation)
                break
            except (TypeError, jinja2.TemplateError) as exc:
                if attempt == len(attempts):
                    raise InvalidParameterError(
                        "messages", f"the model's chat template cannot render them ({exc})"
                    ) from exc
        messages = conversation
        return _cut_after_final_message(text, messages) if continue_final_message else text

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The template writes the special tokens itself, so none are added here.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def encode_user_prompt(self, text: str) -> list[int]:
        """``text`` as a user's message in the chat template, or as it is when the
        model has no template (a base model)."""
        if self.chat_template_source is None:
            return self.encode(text)
        return self.encode_chat([{"role": "user", "content": text}])


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered conversation up to the end of its last message's content, found as
    transformers finds it (the last occurrence; a template that trims the content is
    cut after the trimmed text)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise InvalidParameterError(
            "continue_final_message",
            "the final message's text does not appear in the rendered conversation",
        )
    at = text.rindex(final.strip())
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]
