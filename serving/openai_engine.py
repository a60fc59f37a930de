"""HTTP client engine for an OpenAI-compatible server: vLLM, the production engine, or ``flywheel serve``
(the reference engine) on a host without vLLM.

Generation uses ``POST /v1/completions`` with the prompt as token ids, ``logprobs: 0`` (only the
sampled token's log-prob), ``return_token_ids: true`` (vLLM >= 0.10.2: ``choices[i].token_ids``)
and ``return_tokens_as_token_ids: true`` (``logprobs.tokens`` as ``"token_id:<id>"``, the fallback
for older vLLM). Start vLLM with ``--logprobs-mode processed_logprobs`` so its log-probs follow the
engine invariant (tempered, nucleus-renormalised), and ``--served-model-name`` of your choice.

Weight reload, the calls that work on vLLM 0.32 (server started with ``VLLM_SERVER_DEV_MODE=1``,
as :mod:`serving.vllm_server` does), in order:

1. ``POST /pause?mode=wait`` lets in-flight requests finish and holds new ones, so no completion
   mixes two checkpoints;
2. ``POST /collective_rpc {"method": "reload_checkpoint", "kwargs": {"weights_path": PATH}}`` reloads
   the weights in place from the checkpoint folder PATH (readable by the server: a shared volume).
   ``reload_checkpoint`` is flywheel's worker extension (:mod:`serving.vllm_worker`, the server
   started with ``--worker-extension-cls serving.vllm_worker.WeightReload``): vLLM's
   ``reload_weights`` followed by a refresh of the layers that share a weight, without which a tied
   LM head keeps the previous checkpoint's packed weight on CPU;
3. ``POST /reset_prefix_cache`` drops cached prefixes computed with the old weights;
4. ``POST /update_weight_version {"new_version": CHECKPOINT_ID}`` records which checkpoint serves:
   ``GET /weight_info`` answers it, so any client can ask the server what it serves;
5. ``POST /resume``, also after a failed step.

Each of these is an admin route of a keyed server (:mod:`serving.vllm_auth`): the client sends its
``admin_key`` on them and its ``api_key`` everywhere else, so the inference key alone gets 403 there
(reported as an :class:`InfrastructureError` naming the admin key settings).

A folder that is not a complete checkpoint is refused before step 2: vLLM 0.32 takes a missing
path for a hub repo id and its engine dies on the error. A reload that fails raises
:class:`InfrastructureError` naming what serves now (the old checkpoint, or nothing if the server
died); the engine's ``checkpoint_id`` moves only after every step succeeded.

MoE routes: a vLLM server started with ``--enable-return-routed-experts`` adds
``choices[i].routed_experts``, a base64 ``.npy`` array ``[rows, moe_layers, top_k]``: the experts
each token was routed to at the position it was *input* at, for positions
``routed_experts_prompt_start`` (a request field) to the last one forwarded (the final sampled token
never is). flywheel's :class:`Generation` indexes a completion token by the position whose output
*sampled* it, one to the left (``serving.reference_engine``): token 0 by the last prompt position,
token ``i`` by generated token ``i - 1``. So every request asks for rows from the shortest prompt's
last position on, and :func:`sampling_routes` takes each choice's ``len(completion)`` rows from its
own last prompt position. A choice without them (a dense model, the flag off, or vLLM's CPU build,
which cannot capture routes: it needs the V2 model runner, which needs a GPU Triton) yields
``routed_experts=None``, and the trainer routes those tokens itself.

Through the serving front (``flywheel front``): :meth:`OpenAICompatEngine.for_user` gives a client
that sends the OpenAI ``user`` field (the front routes by it) and takes its ``checkpoint_id`` from
the ``x-flywheel-checkpoint`` header of each answer, so a session's ``model.responded`` names the
checkpoint the front reports served that very request. Against a plain server the header is absent
and the checkpoint stays the one the server reported at connect.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import numpy as np
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential
from transformers import AutoTokenizer

from app.checkpoints.store import check_hf_folder
from app.checkpoints.tokenizer import smollm2_tokenizer_dir
from app.core.errors import InfrastructureError
from app.inference.engine import Generation, InferenceEngine, SamplingParams
from serving.vllm_server import server_healthy

_RETRY: dict[str, Any] = dict(
    retry=retry_if_exception_type(httpx.TransportError),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.5, max=8),
    reraise=True,
)


def _token_ids(choice: dict[str, Any]) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens is None:
        raise InfrastructureError("server returned neither token_ids nor logprobs.tokens")
    out = []
    for t in tokens:
        if not str(t).startswith("token_id:"):
            raise InfrastructureError(f"server did not honour return_tokens_as_token_ids (got {t!r})")
        out.append(int(str(t).split(":", 1)[1]))
    return out


def _route_array(value: str) -> np.ndarray:
    """``[rows, layers, top_k]`` int64 routes from vLLM's encoding (base64 of ``np.save`` bytes,
    ``vllm.utils.serial_utils.numpy2base64``).

    Raises:
        InfrastructureError: not a base64 ``.npy`` of a 3-D integer array.
    """
    try:
        arr = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, OSError, binascii.Error) as exc:
        raise InfrastructureError(f"routed experts are not a base64 .npy array: {exc}") from exc
    if arr.ndim != 3 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InfrastructureError(f"routed experts of shape {arr.shape} ({arr.dtype}), need [tokens, layers, top_k]")
    return arr.astype(np.int64)


def sampling_routes(
    choice: dict[str, Any], prompt_len: int, routes_start: int, n_tokens: int
) -> list[list[list[int]]] | None:
    """A choice's routes in :class:`Generation` order (see the module docstring), or None.

    Args:
        choice: one ``choices[i]`` of a ``/v1/completions`` answer.
        prompt_len: tokens of that choice's prompt.
        routes_start: the request's ``routed_experts_prompt_start`` (the position of row 0).
        n_tokens: completion tokens of the choice.

    Returns:
        ``[n_tokens][layers][top_k]`` expert ids, or None when the server sent no routes.

    Raises:
        InfrastructureError: routes that are not vLLM's encoding, or fewer rows than the completion
            needs (``prompt_len - 1 - routes_start + n_tokens``).
    """
    value = choice.get("routed_experts")
    if value is None or n_tokens == 0:
        return None
    rows = _route_array(value)
    first = prompt_len - 1 - routes_start
    if first < 0 or len(rows) < first + n_tokens:
        raise InfrastructureError(
            f"{len(rows)} routed-expert rows from position {routes_start} for a {prompt_len}-token prompt "
            f"and {n_tokens} completion tokens (need {first + n_tokens})"
        )
    return rows[first : first + n_tokens].tolist()


CHECKPOINT_HEADER = "x-flywheel-checkpoint"  # set by the serving front (serving.front) on every answer


class OpenAICompatEngine(InferenceEngine):
    """Client of an OpenAI-compatible completions server (vLLM, ``flywheel serve``).

    Args:
        base_url: e.g. ``http://127.0.0.1:8001`` (without ``/v1``).
        api_key: the inference key (bearer token), if the server wants one.
        admin_key: the server's admin key, sent instead of ``api_key`` on the weight-reload routes
            (only the serving watcher and the eval runner hold one); without it those get ``api_key``.
        model: served model name (default: the first of ``GET /v1/models``).
        tokenizer_dir: where to load the tokenizer from (default: the served model's ``root``
            folder when it exists locally, else the SmolLM2 tokenizer).
        timeout_s: per-request timeout (seconds); generation of long batches can be slow on CPU.
        transport: an ``httpx`` transport (tests pass an ASGI transport).
        on_reload: called with ``(checkpoint_id, folder)`` after every successful reload (a managed
            server records it, so a restart serves the same checkpoint).
        dtype: the dtype the server computes in, when known (a managed server's), reported with
            every generation's log-probs.
        user: the OpenAI ``user`` sent with every completion (the serving front routes by it).

    Raises:
        InfrastructureError: the server is unreachable or answers with an error.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        model: str | None = None,
        tokenizer_dir: Path | None = None,
        timeout_s: float = 600.0,
        transport: httpx.BaseTransport | None = None,
        on_reload: Callable[[str, Path], None] | None = None,
        dtype: str | None = None,
        user: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
        self._on_reload = on_reload
        self.dtype = dtype
        self.user = user
        self._owns_http = True
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        listing = self._call("GET", "/v1/models")
        info = listing.json()["data"][0]
        self.model = model or info["id"]
        self.checkpoint_id = (
            listing.headers.get(CHECKPOINT_HEADER)
            or self.served_checkpoint()
            or info.get("checkpoint_id")
            or self.model
        )
        self.max_context_tokens = int(info.get("max_model_len") or 8192)
        self.tokenizer = self._load_tokenizer(tokenizer_dir or (Path(info["root"]) if info.get("root") else None))

    @staticmethod
    def _load_tokenizer(path: Path | None):
        if path is None or not (path / "tokenizer_config.json").exists():
            path = smollm2_tokenizer_dir()
        return AutoTokenizer.from_pretrained(path)

    @retry(**_RETRY)
    def _send(self, method: str, url: str, body: dict | None, headers: dict[str, str] | None = None) -> httpx.Response:
        return self._http.request(method, url, json=body, headers=headers)

    def _call(self, method: str, url: str, body: dict | None = None, *, admin: bool = False) -> httpx.Response:
        try:
            resp = self._send(method, url, body, self._admin_headers if admin else None)
        except httpx.TransportError as exc:
            raise InfrastructureError(f"inference server unreachable at {self._http.base_url}: {exc}") from exc
        if resp.status_code == 403 and admin:
            raise InfrastructureError(
                f"{method} {url} -> 403: this client's key may not use the server's weight-reload routes; only "
                "the serving watcher (FLYWHEEL_SERVING_ADMIN_KEY) and the eval runner on the eval server "
                "(FLYWHEEL_SERVING_EVAL_ADMIN_KEY) hold an admin key"
            )
        if resp.status_code >= 400:
            raise InfrastructureError(f"{method} {url} -> {resp.status_code}: {resp.text[:500]}")
        return resp

    def _request(self, method: str, url: str, body: dict | None = None, *, admin: bool = False) -> dict[str, Any]:
        resp = self._call(method, url, body, admin=admin)
        return resp.json() if resp.content else {}

    def for_user(self, user_id: str) -> "OpenAICompatEngine":
        """A client for one user's session: the same connection pool, ``user`` sent with every
        completion, and ``checkpoint_id`` what the serving front stamped on the latest answer (at
        first, what it stamps for this user's route on ``GET /v1/models?user=``). Use one per
        session: its ``checkpoint_id`` follows that session's requests only.

        Raises:
            InfrastructureError: the server is unreachable or errs.
        """
        view = copy.copy(self)
        view.user, view._owns_http = user_id, False
        resp = self._call("GET", "/v1/models?" + urlencode({"user": user_id}))
        view.checkpoint_id = resp.headers.get(CHECKPOINT_HEADER) or self.checkpoint_id
        return view

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One ``/v1/completions`` request for the whole batch; latency is the request's wall time.

        Raises:
            InfrastructureError: the server is unreachable, errs, or answers with mismatched
                token, log-prob or route counts.
        """
        if not prompts:
            return []
        body = {
            "model": self.model,
            "prompt": [list(map(int, p)) for p in prompts],
            "n": 1,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if self.user is not None:
            body["user"] = self.user
        routes_start = max(min(len(p) for p in prompts) - 1, 0)
        body["routed_experts_prompt_start"] = routes_start  # ignored by a server that returns none
        t0 = time.perf_counter()
        resp = self._call("POST", "/v1/completions", body)
        latency = time.perf_counter() - t0
        data = resp.json()
        self.checkpoint_id = resp.headers.get(CHECKPOINT_HEADER) or self.checkpoint_id
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise InfrastructureError(f"asked for {len(prompts)} completions, got {len(choices)}")
        out = []
        for c, prompt in zip(choices, prompts):
            ids = _token_ids(c)
            lps = [float(x) for x in (c.get("logprobs") or {}).get("token_logprobs") or []]
            if len(lps) != len(ids):
                raise InfrastructureError(f"{len(lps)} log-probs for {len(ids)} tokens")
            out.append(
                Generation(
                    token_ids=ids,
                    logprobs=lps,
                    finish_reason=c.get("finish_reason") or "stop",
                    latency_s=latency,
                    routed_experts=sampling_routes(c, len(prompt), routes_start, len(ids)),
                    dtype=self.dtype,
                )
            )
        return out

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        """Reload the server's weights from the checkpoint folder ``path`` (see the module docstring).

        Raises:
            CheckpointError: ``path`` is not a complete model folder (nothing was sent).
            InfrastructureError: a reload step failed; the message says what the server serves now.
        """
        check_hf_folder(Path(path))
        previous = self.checkpoint_id
        self._request("POST", "/pause?mode=wait", admin=True)
        try:
            self._request(
                "POST",
                "/collective_rpc",
                {"method": "reload_checkpoint", "kwargs": {"weights_path": str(path)}},
                admin=True,
            )
            self._request("POST", "/reset_prefix_cache", admin=True)
            self._request("POST", "/update_weight_version", {"new_version": checkpoint_id}, admin=True)
        except InfrastructureError as exc:
            alive = self._alive()
            now = f"it still serves {previous}" if alive else "the server is down and serves nothing"
            raise InfrastructureError(f"reload of {checkpoint_id} from {path} failed ({exc}); {now}") from exc
        finally:
            if self._alive():
                self._request("POST", "/resume", admin=True)
        self.checkpoint_id = checkpoint_id
        if self._on_reload is not None:
            self._on_reload(checkpoint_id, Path(path))

    def resume(self) -> None:
        """``POST /resume``: a server whose reload never finished (its caller was killed between
        ``/pause`` and ``/resume``) serves again; a running server is unaffected.

        Raises:
            InfrastructureError: the server is unreachable or refuses (403: no admin key).
        """
        self._request("POST", "/resume", admin=True)

    def _alive(self) -> bool:
        return server_healthy(str(self._http.base_url), timeout_s=10.0)

    def served_checkpoint(self) -> str | None:
        """The checkpoint the server reports it serves (its weight version), or None when it records
        none (a vLLM server nobody reloaded reports ``default``; a server without ``/weight_info``).

        Raises:
            InfrastructureError: the server is unreachable or errs.
        """
        try:
            resp = self._send("GET", "/weight_info", None)
        except httpx.TransportError as exc:
            raise InfrastructureError(f"inference server unreachable at {self._http.base_url}: {exc}") from exc
        if resp.status_code == 404:  # a server without the RL routes: it cannot say
            return None
        if resp.status_code >= 400:
            raise InfrastructureError(f"GET /weight_info -> {resp.status_code}: {resp.text[:500]}")
        version = resp.json().get("weight_version")
        return None if version in (None, "", "default") else str(version)

    def close(self) -> None:
        """Close the connection pool (a :meth:`for_user` client leaves its parent's open)."""
        if self._owns_http:
            self._http.close()
