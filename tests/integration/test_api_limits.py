"""API limits on real Postgres: a body past the limit is a 413 (declared or chunked), and the role is
checked before the body is parsed (a viewer's malformed POST is a 403, an anonymous one a 401)."""

from __future__ import annotations

import pytest

from tests.integration.test_api_support import auth, base, client, make_token, store  # noqa: F401

pytestmark = pytest.mark.integration

WRITES = ["/v1/promotions", "/v1/rollbacks", "/v1/checkpoints/base/reject"]


def _error(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code
    return resp.json()["error"]


@pytest.mark.parametrize("path", WRITES)
def test_a_body_past_the_limit_is_413_declared_or_chunked(client, session, path):
    from app.core.settings import get_settings

    limit = get_settings().api.max_body_bytes
    token = make_token(session, "release_manager")
    big = b'{"reason": "' + b"x" * limit + b'"}'
    err = _error(
        client.post(path, content=big, headers={**auth(token), "content-type": "application/json"}), 413, "too_large"
    )
    assert str(limit) in err["message"]

    def chunks():  # no Content-Length: the limit counts what arrives
        for i in range(0, len(big), 65_536):
            yield big[i : i + 65_536]

    _error(
        client.post(path, content=chunks(), headers={**auth(token), "content-type": "application/json"}),
        413,
        "too_large",
    )


def test_a_body_within_the_limit_reaches_the_endpoint(client, session, base):
    token = make_token(session, "release_manager")
    resp = client.post(
        "/v1/promotions",
        json={"checkpoint_id": "nope", "reason": "r" * 1000, "expected_production_id": "base"},
        headers=auth(token),
    )
    _error(resp, 404, "not_found")


@pytest.mark.parametrize("path", WRITES)
@pytest.mark.parametrize("body", [b"{not json", b'{"unexpected": 1}', b"[]"], ids=["not-json", "wrong-fields", "array"])
def test_the_role_is_checked_before_the_body_is_parsed(client, session, path, body):
    viewer = make_token(session, "viewer")
    headers = {"content-type": "application/json"}
    _error(client.post(path, content=body, headers=headers), 401, "unauthorized")
    _error(client.post(path, content=body, headers={**headers, **auth("fw_not-a-real-token")}), 401, "unauthorized")
    _error(client.post(path, content=body, headers={**headers, **auth(viewer)}), 403, "forbidden")
    allowed = make_token(session, "release_manager")
    assert client.post(path, content=body, headers={**headers, **auth(allowed)}).status_code in (400, 422)
