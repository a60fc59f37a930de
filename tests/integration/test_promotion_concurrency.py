"""Two concurrent promotions against a real server (uvicorn, separate sessions): exactly one wins."""

from __future__ import annotations

import threading

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import select

from app.models import Checkpoint, Outbox, Promotion
from tests.integration.test_api_support import auth, base, live_server, make_token, seed_checkpoint, seed_gate, store  # noqa: F401

pytestmark = pytest.mark.integration


def _race(url: str, headers: dict[str, str], bodies: list[dict]) -> list[httpx.Response]:
    barrier = threading.Barrier(len(bodies))
    results: list[httpx.Response | None] = [None] * len(bodies)

    def worker(i: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            c.get("/healthz")  # connect first, so both requests leave together
            barrier.wait()
            results[i] = c.post("/v1/promotions", json=bodies[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("same_candidate", [False, True], ids=["two-candidates", "same-candidate"])
def test_two_concurrent_promotions_exactly_one_wins(live_server, session, store, base, same_candidate):
    headers = auth(make_token(session, "release_manager", name="alice"))
    ids = ["ckpt-0001"] if same_candidate else ["ckpt-0001", "ckpt-0002"]
    for cid in ids:
        seed_checkpoint(session, store, cid, parent_id="base", generation=1)
        seed_gate(session, cid, "base", passed=True)
    bodies = [
        {"checkpoint_id": ids[i % len(ids)], "reason": f"race {i}", "expected_production_id": "base"} for i in range(2)
    ]
    responses = _race(live_server, headers, bodies)
    codes = sorted(r.status_code for r in responses)
    assert codes == [201, 409], [r.text for r in responses]
    winner = next(r for r in responses if r.status_code == 201).json()["checkpoint_id"]
    loser = next(r for r in responses if r.status_code == 409).json()["error"]
    assert loser["code"] == "conflict" and loser["reasons"]
    session.expire_all()
    production = session.scalars(select(Checkpoint).where(Checkpoint.status == "production")).all()
    assert [c.id for c in production] == [winner]
    assert session.scalar(select(sa.func.count()).select_from(Promotion)) == 1
    assert session.scalar(select(sa.func.count()).select_from(Outbox)) == 1
