"""KVTransferParams: what a client or router asked of the KV connector for one request
(kv_connector.py), parsed and checked once, at the door."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidParameterError


@dataclass(frozen=True)
class KVTransferParams:
    """What a client or router asked of the connector for one request.

    Prefill side: ``do_remote_decode`` keeps the blocks when the request finishes, for a
    decode instance to read. Decode side: ``remote_block_ids`` hold the first
    ``remote_num_tokens`` prompt tokens' K/V on the instance at ``remote_host:port``,
    under lease ``lease_id``; ``prompt_digest`` names those tokens and ``signature``
    is the prefill instance's over all of it (the connector checks both before the
    request is queued: KVConnector.check)."""

    do_remote_decode: bool = False
    remote_block_ids: tuple[int, ...] = ()
    remote_num_tokens: int = 0
    lease_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_engine_id: str | None = None
    prompt_digest: str | None = None
    signature: str | None = None

    @property
    def pulls(self) -> bool:
        """Whether it names remote blocks to read (the decode side's parameters)."""
        return bool(self.remote_block_ids) or self.remote_num_tokens > 0

    def signed_fields(self) -> dict[str, Any]:
        """The fields a prefill instance signs, as it sent them."""
        return {
            "lease_id": self.lease_id,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_num_tokens": self.remote_num_tokens,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_engine_id": self.remote_engine_id,
            "prompt_digest": self.prompt_digest,
        }

    @classmethod
    def parse(
        cls, raw: dict[str, Any], num_prompt_tokens: int, block_size: int
    ) -> KVTransferParams:
        """Check every field a client may send: a wrong type or range is a 400 naming
        it, never silently dropped."""
        do_remote_decode = _field(raw, "do_remote_decode", bool) or False
        if "remote_block_ids" not in raw:
            return cls(do_remote_decode=do_remote_decode)
        tokens, blocks = raw.get("remote_num_tokens"), raw["remote_block_ids"]
        if not _is_int(tokens) or not 0 <= tokens < num_prompt_tokens:
            raise InvalidParameterError(
                "kv_transfer_params.remote_num_tokens", f"must be in [0, {num_prompt_tokens})"
            )
        needed = -(-tokens // block_size)
        if (
            not isinstance(blocks, list)
            or len(blocks) < needed
            or not all(_is_int(b) and b >= 0 for b in blocks)
        ):
            raise InvalidParameterError(
                "kv_transfer_params.remote_block_ids",
                f"must list the {needed} block ids (integers) of {tokens} tokens",
            )
        port = _field(raw, "remote_port", int)
        if port is not None and not 0 < port < 65536:
            raise InvalidParameterError("kv_transfer_params.remote_port", "must be in [1, 65535]")
        return cls(
            do_remote_decode=do_remote_decode,
            remote_block_ids=tuple(blocks[:needed]),
            remote_num_tokens=tokens,
            lease_id=_field(raw, "lease_id", str),
            remote_host=_field(raw, "remote_host", str),
            remote_port=port,
            remote_engine_id=_field(raw, "remote_engine_id", str),
            prompt_digest=_field(raw, "prompt_digest", str),
            signature=_field(raw, "signature", str),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(raw: dict[str, Any], key: str, kind: type) -> Any:
    """``raw[key]`` if present (None if absent or null); any other type is an error."""
    value = raw.get(key)
    if value is None:
        return None
    if not (_is_int(value) if kind is int else isinstance(value, kind)):
        raise InvalidParameterError(
            f"kv_transfer_params.{key}", f"must be {kind.__name__}, got {value!r}"
        )
    return value
