"""Request body size limit: a body past ``FLYWHEEL_API_MAX_BODY_BYTES`` is answered 413, unread.

Invariant: the app never receives (let alone parses) more than ``max_bytes`` of a request body. A
declared ``Content-Length`` past the limit is refused before a byte of the body is read; a body
sent without one (chunked) is read up to the limit and refused as soon as it passes it. A body
within the limit is handed to the app whole (this API's bodies are small JSON objects).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import error_response


class BodySizeLimit:
    """Pure ASGI middleware enforcing the body limit (``max_bytes``, bytes) on HTTP requests."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(
            413,
            "too_large",
            f"the request body is larger than {self.max_bytes} bytes",
            [f"send at most {self.max_bytes} bytes (FLYWHEEL_API_MAX_BODY_BYTES)"],
        )(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body, more, first = bytearray(), True, None
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                first = message
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first or {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
