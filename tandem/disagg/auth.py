"""Trust between the instances of a disaggregated deployment: one shared secret.

Clients are not trusted; the router and the prefill and decode instances that hold
the secret are. What the secret protects (docs/SECURITY.md has the whole picture):

    transfer parameters   a prefill instance signs the parameters it returns (block
                          ids, lease, host, port) together with a digest of the
                          prompt tokens they hold and the request's cache_salt; a
                          decode instance acts only on parameters whose signature
                          verifies and whose digest matches its own request's prompt
                          and salt. A client cannot forge them, point a decode
                          instance at another host, or read another tenant's prompt.
    KV reads              every read and release names its lease with a token only
                          the secret can make; the prefill side serves only blocks
                          of that live lease.

Signatures are HMAC-SHA256 over a canonical encoding (sorted JSON) of the signed fields.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from typing import Any

from tandem.errors import TandemError

SECRET_ENV = "TANDEM_KV_SECRET"


class KVAuth:
    def __init__(self, secret: str) -> None:
        if not secret:
            raise TandemError("the KV secret is empty")
        self._key = hashlib.sha256(b"tandem-kv:" + secret.encode()).digest()

    @classmethod
    def from_config(cls, secret: str | None) -> KVAuth:
        """The configured secret (--kv-secret), else $TANDEM_KV_SECRET; one is needed."""
        secret = secret or os.environ.get(SECRET_ENV)
        if not secret:
            raise TandemError(
                f"a prefill or decode instance needs the deployment's shared secret: set "
                f"{SECRET_ENV} (or --kv-secret) to the same value on the router and on "
                f"every instance"
            )
        return cls(secret)

    def _mac(self, purpose: str, payload: Any) -> str:
        message = json.dumps([purpose, payload], sort_keys=True, separators=(",", ":"))
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()

    def sign(self, params: dict[str, Any]) -> str:
        """The signature of transfer parameters (every field but the signature)."""
        return self._mac("params", {k: v for k, v in params.items() if k != "signature"})

    def verify(self, params: dict[str, Any]) -> bool:
        given = params.get("signature")
        return isinstance(given, str) and hmac.compare_digest(given, self.sign(params))

    def lease_token(self, lease_id: str) -> str:
        """What a reader presents to read or release lease ``lease_id``."""
        return self._mac("lease", lease_id)

    def check_lease_token(self, lease_id: Any, token: Any) -> bool:
        if not isinstance(lease_id, str) or not isinstance(token, str):
            return False
        return hmac.compare_digest(token, self.lease_token(lease_id))


def prompt_digest(token_ids: Sequence[int], cache_salt: str | None) -> str:
    """Names exactly the tokens (and salt) whose K/V a lease holds."""
    message = json.dumps([cache_salt, list(token_ids)], separators=(",", ":"))
    return hashlib.sha256(message.encode()).hexdigest()
