"""Typed exceptions for the gRPC status codes the pagedserve server (Ray Serve's gRPC proxy) returns.

Callers catch `InvalidArgument` or `ResourceExhausted` instead of comparing `grpc.StatusCode`s, and the
server's message (which names the bad field, the full queue, ...) is kept as `.details`.
"""

from __future__ import annotations

import grpc


class PagedServeError(Exception):
    """A failed call: `.code` is the gRPC status code, `.details` the server's message.

    Subclasses carry their code, so `Unavailable("engine restarting")` needs none (handy in tests).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None) -> None:
        if code is not None:
            self.code = code
        self.details = details
        super().__init__(details, self.code)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.details else self.code.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.details!r})"


class InvalidArgument(PagedServeError):
    """A bad request parameter; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(PagedServeError):
    """The server's queue is full: back off and retry later (the SDK does not retry this itself)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PagedServeError):
    """The server or engine is down or not up yet (raised once the SDK's retries are spent)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PagedServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(PagedServeError):
    code = grpc.StatusCode.CANCELLED


class NotFound(PagedServeError):
    """Usually an unknown application name: the proxy has no app by that name."""

    code = grpc.StatusCode.NOT_FOUND


class InternalError(PagedServeError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PagedServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INTERNAL: InternalError,
    # An unhandled exception in a servicer (or the proxy) surfaces as UNKNOWN: a server bug like INTERNAL.
    grpc.StatusCode.UNKNOWN: InternalError,
}


def from_rpc_error(e: grpc.RpcError) -> PagedServeError:
    """The typed exception for a gRPC error (a plain `PagedServeError` for codes without a subclass)."""
    # A bare grpc.RpcError need not be a grpc.Call (no code()/details()), e.g. from a custom interceptor.
    code_fn = getattr(e, "code", None)
    details_fn = getattr(e, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return _BY_CODE.get(code, PagedServeError)(details or "", code)
