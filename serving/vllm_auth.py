"""The inference servers' two keys, checked on every route (``--middleware
serving.vllm_auth.require_key`` on a managed vLLM server, :mod:`serving.vllm_server` adds it; the
same check in ``flywheel serve``, :mod:`serving.server`).

Two roles, two keys. The *inference key* (``FLYWHEEL_SERVING_API_KEY``, in the server's environment
as ``VLLM_API_KEY``) is held by every flywheel client: the front, the simulator, the A/B, the eval
runner, the API. The *admin key* (``FLYWHEEL_SERVING_ADMIN_KEY`` for the production and canary
servers, ``FLYWHEEL_SERVING_EVAL_ADMIN_KEY`` for the eval server; in the server's environment as
``FLYWHEEL_VLLM_ADMIN_KEY``) opens the routes that change what or whether the server serves: the
weight reload (``/collective_rpc``, ``/update_weights``, ``/update_weight_version``,
``/start_weight_update``...), ``/pause``, ``/resume``, ``/sleep``, ``/wake_up``, the cache resets,
profiling, scaling. It is held by the serving watcher (production, canary) and the eval runner
(eval server) only.

Invariant: a route is an admin route unless it is on the inference list (:func:`is_admin_route`:
the OpenAI routes under ``/v1/`` but the LoRA loaders, ``/inference/v1/generate``, tokenizing, and
the read-only ``/weight_info``, ``/is_paused``, ``/is_sleeping``, ``/load``, ``/metrics``,
``/version``...), so a route a later vLLM adds is closed to the inference key until listed. Each
route takes exactly one key: the other key gets **403**, no key or an unknown one **401**;
``/health`` (liveness for supervisors) and ``OPTIONS`` are open. A server whose environment has
neither key lets everything through (an unmanaged server); one with only one of them refuses every
route of the other role.

vLLM 0.32's own ``--api-key`` / ``VLLM_API_KEY`` check (``vllm/entrypoints/serve/middleware/
authenticate.py``) also runs, on paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only,
with the inference key: it agrees with this one there, except on the admin routes under those
prefixes (``/inference/v1/abort_requests``, the LoRA loaders), which both checks together close to
either key; flywheel uses none of them. Key comparisons are constant-time on SHA-256 digests, as
vLLM's own.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

OPEN_PATHS = frozenset({"/health"})
ADMIN_KEY_ENV = "FLYWHEEL_VLLM_ADMIN_KEY"  # the admin key in a managed server's environment
INFERENCE_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable: its /v1 check uses the same key
INFERENCE_PREFIXES = ("/v1/", "/v2/")
INFERENCE_PATHS = frozenset(
    {
        "/inference/v1/generate",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/weight_info",
        "/is_paused",
        "/is_sleeping",
        "/get_world_size",
        "/load",
        "/metrics",
        "/version",
        "/ping",
        "/invocations",
        "/generative_scoring",
    }
)
ADMIN_UNDER_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

Next = Callable[[Request], Awaitable[Response]]


def is_admin_route(path: str) -> bool:
    """Whether ``path`` wants the admin key: every path that is not open and not on the inference list."""
    if path in OPEN_PATHS or path in INFERENCE_PATHS:
        return False
    return not (path.startswith(INFERENCE_PREFIXES) and path not in ADMIN_UNDER_V1)


def key_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>`` (constant-time)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), hashlib.sha256(key.encode()).digest())


def refusal(
    method: str, path: str, authorization: str | None, inference_key: str | None, admin_key: str | None
) -> int | None:
    """The status a request gets refused with, or None when it may pass (see the module invariant).

    Args:
        method, path: the request's (path without query string).
        authorization: its ``Authorization`` header, if any.
        inference_key, admin_key: the server's keys; neither set means an open server.

    Returns:
        401 (no key, or one the server does not hold), 403 (the key of the other role) or None.
    """
    if not (inference_key or admin_key) or method == "OPTIONS" or path in OPEN_PATHS:
        return None
    wanted, other = (admin_key, inference_key) if is_admin_route(path) else (inference_key, admin_key)
    if wanted and key_matches(authorization, wanted):
        return None
    if other and key_matches(authorization, other):
        return 403
    return 401


REFUSALS = {401: {"error": "Unauthorized"}, 403: {"error": "Forbidden: this key may not use this route"}}


def _refused(status: int) -> JSONResponse:
    return JSONResponse(REFUSALS[status], status_code=status)


async def require_key(request: Request, call_next: Next) -> Response:
    """Starlette HTTP middleware of a managed vLLM server: its keys from ``VLLM_API_KEY`` and
    ``FLYWHEEL_VLLM_ADMIN_KEY``, each request checked by :func:`refusal`."""
    status = refusal(
        request.method,
        request.url.path,
        request.headers.get("authorization"),
        os.environ.get(INFERENCE_KEY_ENV),
        os.environ.get(ADMIN_KEY_ENV),
    )
    return _refused(status) if status else await call_next(request)


def key_check(inference_key: str | None, admin_key: str | None) -> Callable[[Request, Next], Awaitable[Response]]:
    """The same middleware with the keys given (``flywheel serve``: ``app.middleware("http")(key_check(...))``)."""

    async def check(request: Request, call_next: Next) -> Response:
        status = refusal(
            request.method, request.url.path, request.headers.get("authorization"), inference_key, admin_key
        )
        return _refused(status) if status else await call_next(request)

    return check
