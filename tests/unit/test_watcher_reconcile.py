"""The serving watcher puts production back on a vLLM server that restarted on its start-up model
(a crash or a liveness restart leaves it reporting no weight version, and nothing on the lifecycle
topic moves it): each supervision compares what the server reports with what the watcher serves and
reloads when they differ. Against a stand-in of the server's two routes; the deployed path is
bench/deploy.py's crash of the production vLLM container."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.checkpoints.store import STABLE, CheckpointStore
from app.core.errors import InfrastructureError
from serving.openai_engine import OpenAICompatEngine
from serving.reconcile import reconcile_served


class Server(OpenAICompatEngine):
    """What the watcher sees of a vLLM server: the version it reports and the reloads it takes."""

    def __init__(self, checkpoint_id: str) -> None:  # no HTTP: the two calls reconcile makes
        self.checkpoint_id, self.applies_deltas = checkpoint_id, False
        self.reports: str | None = checkpoint_id
        self.reloads: list[tuple[str, Path]] = []
        self.down = False

    def served_checkpoint(self) -> str | None:
        if self.down:
            raise InfrastructureError("inference server unreachable")
        return self.reports

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        self.reloads.append((checkpoint_id, path))
        self.checkpoint_id = self.reports = checkpoint_id


@pytest.fixture
def store(tmp_path):
    store = CheckpointStore(tmp_path)
    folder = store.root / "ckpt-7"
    folder.mkdir(parents=True)
    (folder / STABLE).touch()
    return store


def test_a_restarted_server_gets_production_back(store):
    server = Server("ckpt-7")
    assert not reconcile_served(server, store) and server.reloads == []  # it serves production: nothing to do
    server.reports = None  # restarted on /checkpoints/base: no weight version
    assert reconcile_served(server, store)
    assert server.reloads == [("ckpt-7", store.stable_path("ckpt-7"))] and server.served_checkpoint() == "ckpt-7"
    server.reports = "base"  # or another checkpoint entirely
    assert reconcile_served(server, store) and len(server.reloads) == 2


def test_a_server_that_does_not_answer_is_tried_again_later(store):
    server = Server("ckpt-7")
    server.down = True
    assert not reconcile_served(server, store) and server.reloads == []
    server.down, server.reports = False, None
    assert reconcile_served(server, store)
