"""Throughput and latency of the promotion API next to a bare FastAPI route serving the same JSON.

Set-up: a scratch Postgres database (on ``--admin-url`` / ``FLYWHEEL_TEST_ADMIN_URL`` / the local
server at 127.0.0.1:5432, else an embedded one), migrated, seeded with 1,000 checkpoints (one in
production, with a promotion row) and a viewer token. Two uvicorn servers, each its own process on
a free loopback port, one worker each:

- *ours*: ``create_app()``: bearer-token lookup, SQLAlchemy session, keyset query, pydantic models;
- *baseline*: a bare FastAPI app whose routes return the very JSON ours returned (fetched once at
  start), with no database and no auth.

The load generator is this process (httpx, asyncio, ``--concurrency`` requests in flight, a fixed
number of requests per endpoint after a warm-up) and drives ``GET /v1/checkpoints`` (the first page,
50 rows, as the dashboard reads it) and ``GET /v1/production``. Rounds alternate ours/baseline and
the median round counts (a shared two-core machine is noisy).

Ends with one JSON line: ours = our aggregate req/s over both endpoints, baseline = the bare app's.
Target ratio >= 0.3: ours pays two Postgres round trips per request (token, then the page or the
production row plus its last promotion) and ORM + validation work on 50 rows, against a route that
serialises a constant; a release-manager API sees a handful of requests per minute, so a 3x budget
over the framework floor is ample, and falling under it would mean a missing index, an N+1 query
or a connection-pool stall, which is what this bench exists to catch.

Flags: ``--quick`` (fewer requests and rounds, about 30 s), ``--requests N`` (per endpoint per
round), ``--concurrency N`` (8), ``--rounds N``, ``--checkpoints N`` (rows seeded; 1,000),
``--admin-url URL`` (libpq URL of a maintenance database).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import httpx
import psycopg
import uvicorn
from fastapi import FastAPI

from app.core.db import reset_engines
from app.core.migrate import upgrade
from app.core.net import free_port as fp
from app.models.checkpoints import CheckpointStatus
from app.repositories.tokens import TOKEN_PREFIX, hash_token
from ops.postgres import start_postgres, stop_postgres

TARGET = 0.3
ENDPOINTS = ("/v1/checkpoints", "/v1/production")


# ---- the bare baseline app (run with --serve-bare) ------------------------------------------------


def bare_app(fixtures: dict[str, object]):
    """A FastAPI app that answers each path in ``fixtures`` with that JSON (no DB, no auth)."""
    app = FastAPI()
    for path, body in fixtures.items():
        app.add_api_route(path, (lambda body=body: body), methods=["GET"])
    return app


def serve_bare(port: int, fixture_file: Path) -> None:
    uvicorn.run(
        bare_app(json.loads(fixture_file.read_text())),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )


# ---- database ------------------------------------------------------------------------------------


def admin_url(explicit: str | None, tmp: Path) -> tuple[str, object | None]:
    """A maintenance-database URL and, if we had to start one, the embedded server's datadir."""
    url = explicit or os.environ.get("FLYWHEEL_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        with psycopg.connect(url, connect_timeout=2):
            return url, None
    except psycopg.Error:
        datadir = tmp / "pgdata"
        server = start_postgres(datadir, database="postgres")
        return f"postgresql://postgres@127.0.0.1:{server.port}/postgres", datadir


def seed(url: str, n: int) -> str:
    """Migrate, insert ``n`` checkpoints (newest in production) and a viewer token; returns the token."""
    upgrade(url=url)
    now = datetime.now(UTC)
    statuses = (
        CheckpointStatus.RETIRED,
        CheckpointStatus.GATE_FAILED,
        CheckpointStatus.REJECTED,
        CheckpointStatus.GATE_PASSED,
        CheckpointStatus.CANDIDATE,
    )
    rows = []
    for i in range(n):
        cid = f"ckpt-{i:05d}"
        status = CheckpointStatus.PRODUCTION if i == n - 1 else statuses[i % len(statuses)]
        rows.append(
            (
                cid,
                f"ckpt-{i - 1:05d}" if i else None,
                status.value,
                f"/srv/checkpoints/{cid}",
                True,
                i,
                "implicit@1",
                json.dumps({"parent_id": f"ckpt-{i - 1:05d}" if i else None}),
                json.dumps({"loss": 0.5 - i * 1e-4, "kl": 0.01}),
                100 + i,
                now - timedelta(minutes=n - i),
            )
        )
    token = TOKEN_PREFIX + uuid.uuid4().hex
    with psycopg.connect(url) as conn:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO checkpoint (id, parent_id, status, path, stable, generation, reward_spec, manifest,"
                " metrics, num_trajectories, trained_on_erased, created_at)"
                " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,false,%s)",
                rows,
            )
            cur.execute(
                "INSERT INTO promotion (id, kind, checkpoint_id, previous_production_id, actor, reason)"
                " VALUES (%s, 'promotion', %s, %s, 'bench', 'seed')",
                (uuid.uuid4(), f"ckpt-{n - 1:05d}", f"ckpt-{n - 2:05d}"),
            )
            cur.execute(
                "INSERT INTO api_token (id, name, role, token_hash) VALUES (%s, 'bench', 'viewer', %s)",
                (uuid.uuid4(), hash_token(token)),
            )
    return token


# ---- servers and load --------------------------------------------------------------------------------


def start(cmd: list[str], env: dict[str, str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("server did not start in 60 s")


async def drive(base: str, path: str, headers: dict[str, str], n: int, concurrency: int) -> dict[str, float]:
    """``n`` GETs with ``concurrency`` in flight; req/s and latency percentiles (ms)."""
    latencies: list[float] = []
    queue = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=30) as client:

        async def worker() -> None:
            for _ in queue:
                t0 = time.perf_counter()
                r = await client.get(path)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"{base}{path} -> {r.status_code}: {r.text[:200]}")

        start_t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start_t
    latencies.sort()
    return {
        "rps": n / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "seconds": elapsed,
    }


def free_port() -> int:
    return fp()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds (about 30 s)")
    ap.add_argument("--requests", type=int, default=None, help="requests per endpoint per round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--checkpoints", type=int, default=1000, help="rows seeded")
    ap.add_argument("--admin-url", default=None, help="libpq URL of a maintenance database")
    ap.add_argument("--serve-bare", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fixtures", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_bare:
        serve_bare(args.serve_bare, args.fixtures)
        return
    n = args.requests or (300 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-api-"))
    admin, embedded = admin_url(args.admin_url, tmp)
    dbname = f"flywheel_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    url = admin.rsplit("/", 1)[0] + "/" + dbname
    procs: list[subprocess.Popen] = []
    try:
        token = seed(url, args.checkpoints)
        env = {
            **os.environ,
            "FLYWHEEL_DATABASE_URL": url,
            "FLYWHEEL_HOME": str(tmp / "home"),
            "FLYWHEEL_TELEMETRY_EXPORTER": "none",
        }
        ours_port, bare_port = free_port(), free_port()
        procs.append(
            start(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "app.api.main:create_app",
                    "--factory",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(ours_port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                ],
                env,
                ours_port,
            )
        )
        ours = f"http://127.0.0.1:{ours_port}"
        headers = {"Authorization": f"Bearer {token}"}
        fixtures = {p: httpx.get(ours + p, headers=headers).json() for p in ENDPOINTS}
        assert len(fixtures["/v1/checkpoints"]["items"]) == 50
        (tmp / "fixtures.json").write_text(json.dumps(fixtures))
        procs.append(
            start(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--serve-bare",
                    str(bare_port),
                    "--fixtures",
                    str(tmp / "fixtures.json"),
                ],
                env,
                bare_port,
            )
        )
        bare = f"http://127.0.0.1:{bare_port}"
        for p in ENDPOINTS:  # same bytes on both sides
            assert httpx.get(bare + p).json() == fixtures[p]

        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for base, hdrs, _label in ((ours, headers, "ours"), (bare, {}, "bare")):  # warm-up
            for p in ENDPOINTS:
                asyncio.run(drive(base, p, hdrs, 50, args.concurrency))
        for _ in range(rounds):
            for base, hdrs, label in ((ours, headers, "ours"), (bare, {}, "bare")):
                for p in ENDPOINTS:
                    results.setdefault((label, p), []).append(asyncio.run(drive(base, p, hdrs, n, args.concurrency)))

        def median(label: str, p: str) -> dict[str, float]:
            runs = sorted(results[(label, p)], key=lambda r: r["rps"])
            return runs[len(runs) // 2]

        print(
            f"{args.checkpoints} checkpoints seeded; {n} requests x {rounds} round(s) per endpoint, "
            f"concurrency {args.concurrency}, loopback, separate processes"
        )
        print(f"{'endpoint':<18}{'server':<10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
        agg = {}
        for label in ("ours", "bare"):
            secs = 0.0
            for p in ENDPOINTS:
                m = median(label, p)
                secs += n / m["rps"]
                print(f"{p:<18}{label:<10}{m['rps']:>10.0f}{m['p50_ms']:>10.2f}{m['p99_ms']:>10.2f}")
            agg[label] = len(ENDPOINTS) * n / secs
        ratio = agg["ours"] / agg["bare"]
        print(
            json.dumps(
                {
                    "bench": "api",
                    "ours": round(agg["ours"], 1),
                    "baseline": round(agg["bare"], 1),
                    "unit": "req/s",
                    "ratio": round(ratio, 3),
                    "target": TARGET,
                    "pass": ratio >= TARGET,
                }
            )
        )
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

        reset_engines()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        if embedded is not None:
            stop_postgres(embedded)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
