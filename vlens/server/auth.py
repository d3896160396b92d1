"""Bearer-key authentication for every route but /health and /lens (a page without data: its calls to the
API carry the key typed into it).

It runs as ASGI middleware, before routing and body parsing, so an unauthenticated caller learns
nothing (not even which paths exist or how a body is validated) and costs no JSON parsing.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from vlens.server.protocol import APIError

OPEN_PATHS = frozenset({"/health", "/lens"})


def presented_key(scope: Scope) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, if there is one."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return key.strip() if scheme.lower() == "bearer" else None
    return None


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        # Compare digests: equal length whatever the caller sends, and compare_digest is constant-time.
        self.digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.digest is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        key = presented_key(scope)
        if key is None:
            error = APIError(
                401, "missing API key: send the header `Authorization: Bearer KEY`", code="invalid_api_key"
            )
        elif not hmac.compare_digest(hashlib.sha256(key.encode()).digest(), self.digest):
            error = APIError(401, "incorrect API key", code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
