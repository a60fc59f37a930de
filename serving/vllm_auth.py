"""The managed vLLM servers' key check on every route, dev routes included (``--middleware
serving.vllm_auth.require_key``; :mod:`serving.vllm_server` adds it).

vLLM 0.32's own ``--api-key`` / ``VLLM_API_KEY`` check (``vllm/entrypoints/serve/middleware/
authenticate.py``) guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``: the
development and RL routes flywheel turns on (``/collective_rpc``, ``/update_weights``,
``/update_weight_version``, ``/weight_info``, ``/pause``, ``/sleep``, ``/reset_prefix_cache``) and
``/tokenize``, ``/metrics``, ``/load`` answer anyone who reaches the port. This middleware, run
inside the vLLM server process, asks for the same key (``Authorization: Bearer <VLLM_API_KEY>``)
on every path except ``/health`` (liveness for supervisors) and answers 401 otherwise. Without
``VLLM_API_KEY`` in the server's environment it lets everything through (an unmanaged server).
The key comparison is constant-time on SHA-256 digests, as vLLM's own.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

OPEN_PATHS = frozenset({"/health"})


def key_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>`` (constant-time)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), hashlib.sha256(key.encode()).digest())


async def require_key(request: Request, call_next) -> Response:
    """Starlette HTTP middleware: 401 for a request without the server's key (see the module doc)."""
    key = os.environ.get("VLLM_API_KEY")
    if key and request.method != "OPTIONS" and request.url.path not in OPEN_PATHS:
        if not key_matches(request.headers.get("authorization"), key):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return await call_next(request)
