"""The auth matrix of the promotion API, on real Postgres: no token -> 401, wrong role -> 403,
right role -> the endpoint's own answer; plus the token CLI (printed once, stored hashed, revocable)."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select

from app.models import ApiToken, AuditLog
from tests.integration.test_api_support import auth, base, client, make_token, store  # noqa: F401

pytestmark = pytest.mark.integration

# (method, path, json body, {role: expected status}) -- a role absent from the map gets 403.
# Writes target a checkpoint that does not exist, so passing auth shows as 404/409, not a change.
MATRIX = [
    ("GET", "/v1/checkpoints", None, {"viewer": 200, "service": 200, "release_manager": 200}),
    ("GET", "/v1/checkpoints/base", None, {"viewer": 200, "service": 200, "release_manager": 200}),
    ("GET", "/v1/checkpoints/base/evals", None, {"viewer": 200, "service": 200, "release_manager": 200}),
    ("GET", "/v1/production", None, {"viewer": 200, "service": 200, "release_manager": 200}),
    ("GET", "/v1/promotions", None, {"viewer": 200, "service": 200, "release_manager": 200}),
    ("GET", "/v1/audit", None, {"viewer": 200, "service": 200, "release_manager": 200}),
    ("GET", "/v1/me", None, {"viewer": 200, "service": 200, "release_manager": 200, "inference": 200}),
    (
        "GET",
        "/v1/reports/00000000-0000-0000-0000-000000000000/report.png",
        None,
        {"viewer": 404, "service": 404, "release_manager": 404},
    ),
    (
        "POST",
        "/v1/promotions",
        {"checkpoint_id": "nope", "reason": "r", "expected_production_id": "base"},
        {"release_manager": 404},
    ),
    ("POST", "/v1/rollbacks", {"reason": "r", "expected_production_id": "base"}, {"release_manager": 409}),
    ("POST", "/v1/checkpoints/nope/reject", {"reason": "r"}, {"service": 404, "release_manager": 404}),
]


@pytest.fixture
def tokens(session):
    roles = ("viewer", "service", "release_manager", "inference")  # inference: the front's callers, no API route
    return {role: make_token(session, role, name=f"{role}-token") for role in roles}


def _assert_error(resp, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["reasons"], list)


@pytest.mark.parametrize("method,path,body,allowed", MATRIX, ids=[f"{m} {p}" for m, p, _, _ in MATRIX])
def test_auth_matrix(client, base, tokens, method, path, body, allowed):
    no_token = client.request(method, path, json=body)
    _assert_error(no_token, 401, "unauthorized")
    assert no_token.headers["www-authenticate"] == "Bearer"
    _assert_error(client.request(method, path, json=body, headers=auth("fw_not-a-real-token")), 401, "unauthorized")
    _assert_error(
        client.request(method, path, json=body, headers={"Authorization": "Basic dXNlcjpwYXNz"}), 401, "unauthorized"
    )
    for role, token in tokens.items():
        resp = client.request(method, path, json=body, headers=auth(token))
        expected = allowed.get(role, 403)
        assert resp.status_code == expected, (role, resp.text)
        if expected == 403:
            _assert_error(resp, 403, "forbidden")


def test_revoked_token_stops_working_and_writes_are_attributed(client, base, session, tokens):
    from app.repositories.tokens import revoke_token

    headers = auth(tokens["service"])
    assert client.get("/v1/me", headers=headers).json() == {
        "name": "service-token",
        "role": "service",
        "permissions": ["read", "reject"],
    }
    revoke_token(session, "service-token", actor="test-admin")
    session.commit()
    _assert_error(client.get("/v1/me", headers=headers), 401, "unauthorized")
    actions = [(a.actor, a.action, a.target) for a in session.scalars(select(AuditLog).order_by(AuditLog.id))]
    assert ("test-admin", "token.revoked", "token:service-token") in actions


def test_tokens_cli_prints_once_stores_hash_and_revokes(db, session):
    from typer.testing import CliRunner

    from ops.cli import app

    runner = CliRunner()
    created = runner.invoke(app, ["tokens", "create", "--role", "release_manager", "--name", "alice"])
    assert created.exit_code == 0, created.output
    raw = created.stdout.strip().splitlines()[0]
    assert raw.startswith("fw_") and len(raw) > 40
    row = session.scalars(select(ApiToken).where(ApiToken.name == "alice")).one()
    assert row.token_hash == hashlib.sha256(raw.encode()).hexdigest() and raw not in row.token_hash
    assert row.role == "release_manager"

    duplicate = runner.invoke(app, ["tokens", "create", "--role", "viewer", "--name", "alice"])
    assert duplicate.exit_code != 0
    bad_role = runner.invoke(app, ["tokens", "create", "--role", "admin", "--name", "bob"])
    assert bad_role.exit_code != 0

    listed = runner.invoke(app, ["tokens", "list"])
    assert "alice" in listed.stdout and raw not in listed.stdout
    revoked = runner.invoke(app, ["tokens", "revoke", "alice"])
    assert revoked.exit_code == 0, revoked.output
    session.expire_all()
    assert session.get(ApiToken, row.id).revoked_at is not None
    again = runner.invoke(app, ["tokens", "revoke", "alice"])
    assert again.exit_code != 0
    # The name is free again once revoked.
    assert runner.invoke(app, ["tokens", "create", "--role", "viewer", "--name", "alice"]).exit_code == 0
    audit = [a.action for a in session.scalars(select(AuditLog).order_by(AuditLog.id))]
    assert audit == ["token.created", "token.revoked", "token.created"]


def test_health_and_dashboard_need_no_token(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    missing = client.get("/v1/does-not-exist")
    _assert_error(missing, 404, "not_found")


def test_readyz_reports_each_unreachable_dependency(client, kafka_bootstrap, monkeypatch):
    from app.core.settings import get_settings

    get_settings.cache_clear()
    assert client.get("/readyz").json() == {"status": "ready", "checks": {"database": "ok", "broker": "ok"}}
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    get_settings.cache_clear()
    resp = client.get("/readyz")
    _assert_error(resp, 503, "unavailable")
    assert resp.json()["error"]["reasons"] == ["broker: 127.0.0.1:1 does not answer"]


def test_a_database_behind_this_release_is_not_ready_and_its_requests_are_503s(
    client, kafka_bootstrap, empty_database, monkeypatch
):
    """The API pointed at a database without this release's migrations: ``/readyz`` says so (so a
    deploy holds traffic back) and what it would need; a request that reaches a missing table is a
    503 naming the cause, not a 500."""
    from alembic.script import ScriptDirectory

    from app.core.db import reset_engines
    from app.core.migrate import alembic_config, head_revisions, upgrade
    from app.core.settings import get_settings

    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", empty_database)
    get_settings.cache_clear()
    reset_engines()
    resp = client.get("/readyz")
    _assert_error(resp, 503, "unavailable")
    assert resp.json()["error"]["reasons"] == [
        "database: the database has no flywheel schema (it was never migrated): run `flywheel db upgrade`"
    ]
    resp = client.get("/v1/production", headers={"Authorization": "Bearer fw_anything"})
    _assert_error(resp, 503, "unavailable")
    assert "not migrated" in resp.json()["error"]["message"]

    (head,) = head_revisions()
    previous = ScriptDirectory.from_config(alembic_config()).get_revision(head).down_revision  # not head - 1: ids skip
    upgrade(url=empty_database, revision=previous)
    reasons = client.get("/readyz").json()["error"]["reasons"]
    assert reasons == [
        f"database: the database schema is at revision {previous}; this release needs {head}: run `flywheel db upgrade`"
    ]
    upgrade(url=empty_database)
    assert client.get("/readyz").json()["status"] == "ready"


def test_a_database_that_does_not_answer_is_a_503_not_a_500(client, monkeypatch):
    """A request that needs Postgres while it is down (a restart, a failover): 503 ``unavailable``
    with ``Retry-After``, which clients retry, not a 500 that reads as a bug of ours."""
    from app.core.db import reset_engines
    from app.core.net import free_port
    from app.core.settings import get_settings

    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/flywheel")
    get_settings.cache_clear()
    reset_engines()
    try:
        resp = client.get("/v1/production", headers={"Authorization": "Bearer fw_anything"})
        _assert_error(resp, 503, "unavailable")
        assert resp.headers["Retry-After"] == "5" and "database" in resp.json()["error"]["message"]
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
        reset_engines()


def test_the_plaintext_token_is_stored_and_logged_nowhere(db, client, caplog):
    """Issue 56: API tokens stored only as hashes. After a token is created (CLI), used for a read and
    a write, and revoked, no column of any table and no log line holds its plaintext; only its
    sha256 is in ``api_token``."""
    import psycopg
    from typer.testing import CliRunner

    from ops.cli import app

    runner = CliRunner()
    with caplog.at_level("DEBUG"):
        created = runner.invoke(app, ["tokens", "create", "--role", "release_manager", "--name", "carol"])
        assert created.exit_code == 0, created.output
        raw = created.stdout.strip().splitlines()[0]
        assert client.get("/v1/me", headers=auth(raw)).status_code == 200
        rejected = client.post("/v1/checkpoints/nope/reject", json={"reason": "r"}, headers=auth(raw))
        assert rejected.status_code == 404  # authenticated, then the checkpoint is missing
        assert runner.invoke(app, ["tokens", "revoke", "carol"]).exit_code == 0
        assert client.get("/v1/me", headers=auth(raw)).status_code == 401
    assert raw not in caplog.text
    secret_part = raw.removeprefix("fw_")
    with psycopg.connect(db) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT quote_ident(table_schema) || '.' || quote_ident(table_name) FROM information_schema.tables "
                "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') AND table_type = 'BASE TABLE'"
            )
        ]
        assert "public.api_token" in tables
        holding = [
            t
            for t in tables
            if conn.execute(f"SELECT count(*) FROM {t} x WHERE x::text LIKE %s", (f"%{secret_part}%",)).fetchone()[0]
        ]
        hashed = conn.execute(
            "SELECT count(*) FROM api_token WHERE token_hash = %s", (hashlib.sha256(raw.encode()).hexdigest(),)
        ).fetchone()[0]
    assert holding == [] and hashed == 1
