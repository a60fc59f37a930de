"""The serving front's key check against the real token table: only a live ``inference`` token
calls the front; a viewer's, a release manager's or a revoked token does not."""

from __future__ import annotations

from app.core.db import session_scope
from app.repositories.tokens import create_token, revoke_token
from serving.front_keys import FrontKeys, token_lookup


def test_only_a_live_inference_token_is_a_caller_of_the_front(db):
    with session_scope() as session:
        _, backend = create_token(session, name="product-backend", role="inference", actor="test")
        _, viewer = create_token(session, name="dashboard", role="viewer", actor="test")
        _, manager = create_token(session, name="alice", role="release_manager", actor="test")
    caller = token_lookup(backend)
    assert caller is not None and caller.name == "product-backend"
    assert token_lookup(viewer) is None and token_lookup(manager) is None
    assert token_lookup("fw_not-a-token") is None
    with session_scope() as session:
        revoke_token(session, "product-backend", actor="test")
    assert token_lookup(backend) is None
    assert FrontKeys(ttl_s=0.001).resolve(backend) is None
