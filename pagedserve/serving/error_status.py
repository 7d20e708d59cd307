"""Server-side errors as statuses: every exception a request meets maps to one gRPC code and one HTTP
status, with the message the client sees. Nothing escapes as UNKNOWN."""

from __future__ import annotations

import logging
import re

import grpc

from pagedserve.engine.request_errors import QueueFull, RequestFailed

log = logging.getLogger(__name__)


class ClientError(Exception):
    """A request the server will not run, with the gRPC and HTTP status that says why."""

    def __init__(self, code: grpc.StatusCode, http_status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.http_status, self.message, self.param = code, http_status, message, param

    def __reduce__(self):  # Ray pickles exceptions between processes
        return ClientError, (self.code, self.http_status, self.message, self.param)


def classify(e: BaseException) -> ClientError:
    """Map an exception (possibly wrapped by Ray) to a status."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(e, ClientError):
        return e
    root = e
    while getattr(root, "cause", None) is not None and root.cause is not root:
        root = root.cause
    message = str(root).strip() or type(root).__name__
    if isinstance(root, ValueError):
        # Messages start with the field they name: "temperature=-1.0 must be ...", "messages[0].role: ..."
        field = re.match(r"[A-Za-z_][\w.\[\]]*", message)
        return ClientError(grpc.StatusCode.INVALID_ARGUMENT, 400, message, field.group(0) if field else None)
    if isinstance(root, QueueFull | BackPressureError):
        return ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, message)
    if isinstance(root, RequestFailed | RayActorError | DeploymentUnavailableError):
        return ClientError(grpc.StatusCode.UNAVAILABLE, 503, f"engine unavailable: {message}")
    log.exception("unexpected error", exc_info=e)
    return ClientError(grpc.StatusCode.INTERNAL, 500, f"internal error: {type(root).__name__}: {message}")
