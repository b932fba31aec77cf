"""Errors a user can cause and fix. The CLI prints their message as one line."""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error tandem raises on purpose for bad input."""


class ModelLoadError(TandemError):
    """A model folder, its config, weights or tokenizer cannot be used."""


class InvalidParameterError(TandemError, ValueError):
    """A request setting is out of range; ``param`` names it (the server's 400 ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class QueueFullError(TandemError):
    """The waiting queue is at its configured limit; the client should retry later."""


class RequestFailedError(TandemError):
    """One request failed inside the engine (the others went on)."""


class EngineStepError(TandemError):
    """A step failed (a bug or an out-of-memory); the requests in it are lost."""


class EngineDeadError(TandemError):
    """The engine core (its thread or its process) has stopped; nothing more is served."""


def require_unicode(text: str, param: str) -> None:
    """JSON can carry a lone surrogate ("\\ud800"), which no tokenizer encodes: refuse it
    as a bad ``param`` (a 400), where it would otherwise fail inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidParameterError(param, "is not valid Unicode (a lone surrogate)") from None
