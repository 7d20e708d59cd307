"""Client SDK for a pagedserve server: `Client` (sync) and `AsyncClient` (asyncio) over gRPC.

Exports resolve lazily so that `pagedserve.client.commands`, whose parser the offline `pagedserve generate`
command also builds, can be imported without loading grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "Client", "AsyncClient", "Completion", "Choice", "StreamChunk", "TokenLogprob", "ResponseStream",
    "AsyncResponseStream", "PagedServeError", "InvalidArgument", "ResourceExhausted", "Unavailable",
    "DeadlineExceeded", "Cancelled", "NotFound", "InternalError", "Unauthenticated", "from_rpc_error",
]
_FROM_ERRORS = {"PagedServeError", "InvalidArgument", "ResourceExhausted", "Unavailable", "DeadlineExceeded",
                "Cancelled", "NotFound", "InternalError", "Unauthenticated", "from_rpc_error"}

if TYPE_CHECKING:
    from pagedserve.client.errors import (
        Cancelled,
        DeadlineExceeded,
        InternalError,
        InvalidArgument,
        NotFound,
        PagedServeError,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
        from_rpc_error,
    )
    from pagedserve.client.sdk import (
        AsyncClient,
        AsyncResponseStream,
        Choice,
        Client,
        Completion,
        ResponseStream,
        StreamChunk,
        TokenLogprob,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{'errors' if name in _FROM_ERRORS else 'sdk'}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
