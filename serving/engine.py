"""The one engine factory: a vLLM (or any OpenAI-compatible) server by role, or the in-process
reference engine, for the production checkpoint or a named one (the interface is
:mod:`app.inference.engine`).

Invariants:

- each role has its own server, found by :func:`server_url`: ``production`` (what users are served
  by; only the serving watcher moves its weights), ``eval`` (candidates' evals, never the production
  server) and ``canary`` (a canary's checkpoint beside production); the serving front finds its
  upstreams through the same function;
- the reference engine (``FLYWHEEL_SERVING_ENGINE=reference``) is this process's own, whatever the role:
  tests and hosts without vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, overload

from app.checkpoints.store import CheckpointStore
from app.core.db import session_scope
from app.core.errors import ConfigurationError
from app.core.settings import Settings, flywheel_home, get_settings, secret_value
from app.inference.engine import InferenceEngine
from app.repositories.checkpoints import require_production
from serving.canary_server import CANARY_ROLE, ManagedCanaryServer, canary_settings
from serving.openai_engine import OpenAICompatEngine
from serving.reference_engine import ReferenceEngine
from serving.vllm_server import VLLMServer, ensure_server, record_checkpoint

ENGINE_TYPES = ("vllm", "openai", "reference")
ROLES = ("production", "eval", "canary")
Role = Literal["production", "eval", "canary"]
_URL_SETTINGS = {
    "production": "FLYWHEEL_SERVING_URL",
    "eval": "FLYWHEEL_SERVING_EVAL_URL",
    "canary": "FLYWHEEL_SERVING_CANARY_URL",
}


def server_url(role: str, settings: Settings | None = None) -> str | None:
    """The base URL of the role's server: the role's setting, else (production, canary) the managed
    server this host runs for it (``$FLYWHEEL_HOME/vllm/<role>.json``), else None."""
    settings = settings or get_settings()
    configured = {
        "production": settings.serving.url,
        "eval": settings.serving.eval_url,
        "canary": canary_settings().url,
    }[role]
    if configured or role == "eval":
        return configured
    try:
        server = VLLMServer.load(flywheel_home(), role)
    except (OSError, ValueError):  # removed or replaced while read: the watcher is stopping it
        return None
    return server.url if server is not None else None


@overload
def setup_engine(
    settings: Settings | None = None,
    *,
    checkpoint_id: str | None = None,
    model_dir: Path | None = None,
    engine: str | None = None,
    url: str | None = None,
    role: Literal["production", "eval"] = "production",
) -> InferenceEngine: ...


@overload
def setup_engine(
    settings: Settings | None = None,
    *,
    checkpoint_id: str | None = None,
    model_dir: Path | None = None,
    engine: str | None = None,
    url: str | None = None,
    role: Literal["canary"],
) -> InferenceEngine | ManagedCanaryServer: ...


def setup_engine(
    settings: Settings | None = None,
    *,
    checkpoint_id: str | None = None,
    model_dir: Path | None = None,
    engine: str | None = None,
    url: str | None = None,
    role: str = "production",
) -> InferenceEngine | ManagedCanaryServer:
    """Build the configured engine (``FLYWHEEL_SERVING_ENGINE``: ``vllm``, the default, | ``reference``).

    ``vllm`` (alias ``openai``) talks to the role's server (``url``, else :func:`server_url`) and asks
    it to load ``model_dir`` / the checkpoint when one is named, else it serves what the server has.
    A server this host manages (:mod:`serving.vllm_server`) is restarted first if it died, and every
    reload through the client is recorded in its state, so a later restart serves the same
    checkpoint. The client sends the inference key, and on the reload routes the role's admin key
    where this process holds one (``FLYWHEEL_SERVING_ADMIN_KEY``: the watcher;
    ``FLYWHEEL_SERVING_EVAL_ADMIN_KEY``: the eval runner); a process without it that names a
    checkpoint the server does not serve gets the server's 403 as an :class:`InfrastructureError`.
    The ``canary`` role without ``FLYWHEEL_SERVING_CANARY_URL`` starts the managed canary server on
    the checkpoint (:class:`serving.canary_server.ManagedCanaryServer`, warming up in a thread).

    ``reference`` loads ``model_dir`` if given, else the checkpoint ``checkpoint_id`` (default: the
    production checkpoint from the registry) from the checkpoint store, on ``FLYWHEEL_SERVING_DEVICE``.

    Raises:
        ConfigurationError: unknown engine type or role, no URL for the role, an eval URL equal to
            the production URL, or no production checkpoint.
        InfrastructureError: a managed server was down and did not come back, or refused a reload.
    """
    settings = settings or get_settings()
    kind = (engine or settings.serving.engine).lower()
    if kind not in ENGINE_TYPES:
        raise ConfigurationError(f"unknown inference engine {kind!r}; expected one of {', '.join(ENGINE_TYPES)}")
    if role not in ROLES:
        raise ConfigurationError(f"unknown engine role {role!r}; expected one of {', '.join(ROLES)}")
    if kind == "reference":
        cid, path = resolve_checkpoint(checkpoint_id, model_dir)
        return ReferenceEngine(path, checkpoint_id=cid, device=settings.serving.device)
    if role == CANARY_ROLE and url is None and not canary_settings().url:
        cid, path = resolve_checkpoint(checkpoint_id, model_dir)
        return ManagedCanaryServer(cid, path, settings=settings.serving, drain_s=canary_settings().drain_s)
    base_url = url or (settings.serving.url if role == "production" else server_url(role, settings))
    if not base_url:
        raise ConfigurationError(
            f"engine 'vllm' in role {role} needs {_URL_SETTINGS[role]} (an OpenAI-compatible server"
            + (" that does not serve production)" if role == "eval" else ")")
        )
    if role == "eval" and settings.serving.url and _same_server(base_url, settings.serving.url):
        raise ConfigurationError(
            f"the eval server {base_url} is the production server: evaluating a candidate "
            "there would swap production's weights; run a second server for evals"
        )
    managed = VLLMServer.load(flywheel_home(), role)
    if managed is not None and _same_server(managed.url, base_url):
        ensure_server(role, settings=settings.serving)  # restarted on its recorded checkpoint if it died
    client = OpenAICompatEngine(
        base_url,
        api_key=secret_value(settings.serving.api_key),
        admin_key=secret_value(settings.serving.admin_key_for(role)),
        on_reload=(lambda cid, path: record_checkpoint(role, cid, path)) if managed is not None else None,
        dtype=managed.dtype if managed is not None else None,
    )
    if model_dir is not None or checkpoint_id is not None:
        cid, path = resolve_checkpoint(checkpoint_id, model_dir)
        if cid != client.checkpoint_id:
            client.load_checkpoint(cid, path)
    return client


def _same_server(a: str, b: str) -> bool:
    return a.rstrip("/").removesuffix("/v1") == b.rstrip("/").removesuffix("/v1")


def resolve_checkpoint(checkpoint_id: str | None, model_dir: Path | None) -> tuple[str, Path]:
    """(checkpoint id, folder) for an explicit folder, a named checkpoint or the production one.

    Raises:
        ConfigurationError: no checkpoint named and none in production.
        CheckpointError: the named checkpoint is not STABLE.
    """
    if model_dir is not None:
        return checkpoint_id or Path(model_dir).resolve().name, Path(model_dir)
    if checkpoint_id is None:
        with session_scope() as session:
            checkpoint_id = require_production(session).id
    return checkpoint_id, CheckpointStore.from_settings().stable_path(checkpoint_id)
