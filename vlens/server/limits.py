"""Request bodies are bounded before anything parses them.

The middleware reads the whole body (refusing it with 413 as soon as it passes the limit, whatever
Content-Length claims) and replays it to the app; later receive() calls go to the server, so the
app still learns when the client disconnects.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlens.server.protocol import APIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        while not too_big:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            too_big = size > self.max_bytes
            if not message.get("more_body", False):
                break
        if too_big:
            error = APIError(413, f"request body larger than this server's limit of {self.max_bytes} bytes")
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
