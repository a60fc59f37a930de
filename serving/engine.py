"""Engines by kind and role: the in-process torch engine, or a vLLM / OpenAI-compatible server, for
the production checkpoint or a named one (the interface is :mod:`app.inference.engine`)."""

from __future__ import annotations

from pathlib import Path

from app.checkpoints.store import CheckpointStore
from app.core.db import session_scope
from app.core.errors import ConfigurationError
from app.core.settings import flywheel_home, get_settings, secret_value
from app.inference.engine import InferenceEngine
from app.repositories.checkpoints import require_production
from serving.vllm_server import VLLMServer, ensure_server, record_checkpoint

ENGINE_TYPES = ("torch", "vllm", "openai")
ROLES = ("production", "eval")


def setup_engine(
    settings=None,
    *,
    checkpoint_id: str | None = None,
    model_dir: Path | None = None,
    engine: str | None = None,
    url: str | None = None,
    role: str = "production",
) -> InferenceEngine:
    """Build the configured engine (``FLYWHEEL_SERVING_ENGINE``: ``torch`` | ``vllm``).

    ``torch`` loads ``model_dir`` if given, else the checkpoint ``checkpoint_id`` (default: the
    production checkpoint from the registry) from the checkpoint store, on
    ``FLYWHEEL_SERVING_DEVICE``; the engine is this process's own, whatever the role. ``vllm``
    (alias ``openai``) talks to a server (vLLM or ``flywheel serve``) and asks it to load
    ``model_dir`` / the checkpoint when one is named, else it serves what the server has. Which
    server depends on ``role``:

    * ``production``: ``url`` / ``FLYWHEEL_SERVING_URL``, the server users are served by (the
      serving watcher and the simulator use it);
    * ``eval``: ``url`` / ``FLYWHEEL_SERVING_EVAL_URL``, a server of its own, so loading a candidate
      never changes the weights production serves.

    A server this host manages (:mod:`serving.vllm_server`) is restarted first if it died, and every
    reload through the client is recorded in its state, so a later restart serves the same checkpoint.
    The client sends the inference key, and on the reload routes the role's admin key where this
    process holds one (``FLYWHEEL_SERVING_ADMIN_KEY``: the watcher; ``FLYWHEEL_SERVING_EVAL_ADMIN_KEY``:
    the eval runner); a process without it that names a checkpoint the server does not serve gets the
    server's 403 as an :class:`InfrastructureError`.

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
    if kind == "torch":
        from serving.torch_engine import TorchEngine

        cid, path = resolve_checkpoint(checkpoint_id, model_dir)
        return TorchEngine(path, checkpoint_id=cid, device=settings.serving.device)
    from serving.openai_engine import OpenAICompatEngine

    base_url = url or (settings.serving.eval_url if role == "eval" else settings.serving.url)
    if not base_url:
        env = "FLYWHEEL_SERVING_EVAL_URL" if role == "eval" else "FLYWHEEL_SERVING_URL"
        raise ConfigurationError(
            f"engine 'vllm' in role {role} needs {env} (an OpenAI-compatible server"
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
