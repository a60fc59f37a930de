"""Schemathesis against the OpenAPI schema, in process (ASGI), on real Postgres: no input the schema
allows (or that negative testing derives from it) makes the API answer 5xx, and every answer
conforms to the documented status codes, content types and response schemas.

Runs as a release manager on a database holding a production checkpoint and a gate-passed
candidate, so write paths go past auth into the promotion service. Examples are capped (below a
minute on two busy cores)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from app.api.main import create_app
from tests.integration.test_api_support import auth, base, gated, make_token, store  # noqa: F401

pytestmark = pytest.mark.integration

schema = schemathesis.openapi.from_asgi("/openapi.json", create_app())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture
def rm_headers(session, gated, kafka_bootstrap):  # the broker makes /readyz answer 200
    return auth(make_token(session, "release_manager", name="fuzzer"))


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_server_errors(case, rm_headers):
    case.call_and_validate(headers=rm_headers, checks=CHECKS)
