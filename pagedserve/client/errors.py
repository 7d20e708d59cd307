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
    """A bad request parameter; the message names the field, and `field_violations` lists (field, description)
    pairs from the status details (google.rpc.BadRequest)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None,
                 field_violations: list[tuple[str, str]] | None = None) -> None:
        super().__init__(details, code)
        self.field_violations = field_violations or []


class Unauthenticated(PagedServeError):
    """No API key, or a wrong one: pass `api_key=` or set PAGEDSERVE_API_KEY."""

    code = grpc.StatusCode.UNAUTHENTICATED


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
    """An unknown application name (the proxy has no app by that name), or a LoRA adapter the server does not
    serve."""

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
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
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
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details or "", code, _field_violations(e))
    return _BY_CODE.get(code, PagedServeError)(details or "", code)


def _field_violations(e: grpc.RpcError) -> list[tuple[str, str]]:
    """The google.rpc.BadRequest in the status details, if the call has one."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(e)
    except (AttributeError, TypeError, ValueError):  # not a grpc.Call, or details that do not match
        return []
    violations = []
    for detail in status.details if status is not None else []:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            violations += [(v.field, v.description) for v in bad.field_violations]
    return violations
