"""How the engine ends a request that did not run to its end, for those who only see the error: the Ingress
(`serving/error_status.py`) maps these to gRPC and HTTP statuses without loading the engine (or torch)."""

from __future__ import annotations


class RequestFailed(RuntimeError):
    """A failed step ended the request; the engine has recovered and serves new requests."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the client should retry later (RESOURCE_EXHAUSTED)."""
