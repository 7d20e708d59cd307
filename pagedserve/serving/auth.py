"""API keys: who may use the server. Keys come from the deploy config (`api_keys`) or the environment
(PAGEDSERVE_API_KEY, comma-separated); only their SHA-256 digests are kept, so a key is never in a log, a
repr or the deployment's arguments."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

from pagedserve.protos import API_KEY_ENV

log = logging.getLogger(__name__)


class ApiKeys:
    def __init__(self, keys: list[str] | tuple[str, ...] = ()) -> None:
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"api_keys[{i}] must be a non-empty string")
        self._digests = tuple(_digest(k.strip()) for k in keys)

    @classmethod
    def resolve(cls, configured: str | list[str] | None) -> ApiKeys:
        """The deploy config's keys if it names any, else the environment's, else none."""
        if configured is None:
            configured = os.environ.get(API_KEY_ENV) or []
        if isinstance(configured, str):
            configured = [k for k in configured.split(",") if k.strip()]
        if not isinstance(configured, list | tuple):
            raise ValueError("api_keys must be a string or a list of strings")
        return cls(configured)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header (or gRPC metadata) value carries a configured key. Every key
        is compared, in constant time, whatever matched."""
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        candidate = _digest(token.strip() if scheme.lower() == "bearer" else "")
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(candidate, digest)
        return ok

    def log_state(self, where: str) -> None:
        if self.enabled:
            log.info("%s: API keys required (%d configured)", where, len(self._digests))
        else:
            log.warning("%s: no API key configured: anyone who reaches its ports can use it (set api_keys in "
                        "the deploy config or %s)", where, API_KEY_ENV)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
