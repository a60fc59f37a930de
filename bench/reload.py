"""Promotion to served weights: how long after a release manager's API call the production vLLM
server answers with the new checkpoint, beside a cold start of that server.

One run, on a fresh embedded stack (its own ``FLYWHEEL_HOME``), on the real SmolLM2-135M-Instruct
(``flywheel model init``) and a second checkpoint ``reload-a`` (its weights perturbed by 1 %
Gaussian noise, so log-probs tell the two apart):

1. *Cold start* (the baseline): the production vLLM server started on ``base`` until it answers
   ``/health`` with its weight version set (``serving.vllm_server.start_server``), the way
   ``flywheel up`` starts it.
2. The deployed path: the API, the outbox relay and the serving watcher (``flywheel up --service``).
   ``reload-a`` is gated against base (``flywheel gate`` on a few held-out tasks, the in-process
   engine, as a stand-in that costs no second server) and promoted through ``POST /v1/promotions``
   (with the audited override where two tasks are insufficient evidence), then production is moved
   back and forth by ``POST /v1/rollbacks``. Each move is timed from the API's answer until the
   production server reports the target in ``/weight_info`` AND a greedy log-prob probe of a fixed
   prompt matches the target's own fingerprint (taken when it first served). ``p50_s`` and
   ``max_s`` over the moves.

Target: ``p50_s <= 5`` and ``p50_s <= cold_start_s / 10``. Flags: ``--quick`` (5 moves; default 9),
``--moves N``, ``--home DIR``, ``--keep``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from app.checkpoints.publish import init_base, register_model
from app.checkpoints.store import CheckpointStore
from app.core.migrate import upgrade
from app.core.net import free_port, served_weight_version
from app.core.settings import get_settings
from app.inference.engine import SamplingParams
from app.models.checkpoints import CheckpointStatus
from ops.processes import Supervisor, wait_http
from ops.stack import StackState, serving_settings, stack_down, stack_up
from serving.openai_engine import OpenAICompatEngine
from serving.vllm_server import start_server

TARGET_P50_S = 5.0
TARGET_COLD_RATIO = 0.10
PROBE = [1, 504, 3458, 282, 253, 1345, 30, 2287, 2115, 314]  # a fixed token-id prompt
CANDIDATE = "reload-a"
REASON = "bench/reload: measuring promotion-to-serving latency on a perturbed copy of base"


def perturbed_copy(base_dir: Path, out: Path, scale: float = 0.01, seed: int = 0) -> Path:
    """``base_dir``'s folder with every floating weight ``w`` replaced by ``w * (1 + scale * N(0, 1))``."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for item in base_dir.iterdir():
        if item.suffix == ".safetensors":
            tensors = load_file(item)
            save_file(
                {
                    k: (v * (1 + scale * torch.randn(v.shape, generator=gen))).to(v.dtype)
                    if v.is_floating_point()
                    else v
                    for k, v in tensors.items()
                },
                out / item.name,
                metadata={"format": "pt"},
            )
        elif item.is_file():
            (out / item.name).write_bytes(item.read_bytes())
    return out


def fingerprint(url: str, key: str | None) -> tuple[int, ...]:
    """Greedy tokens and log-probs (rounded to 0.01 nats) of :data:`PROBE` on the server at ``url``."""
    engine = OpenAICompatEngine(url, api_key=key)
    try:
        g = engine.generate([PROBE], SamplingParams(max_tokens=8, temperature=0.0))[0]
        return (*g.token_ids, *(round(x * 100) for x in g.logprobs))
    finally:
        engine.close()


def wait_served(
    url: str, key: str | None, target: str, expected: tuple[int, ...] | None, timeout_s: float = 300.0
) -> float:
    """Seconds until the server at ``url`` reports ``target`` and (when ``expected`` is given) answers
    the probe with that fingerprint.

    Raises:
        SystemExit: not within ``timeout_s``.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        served = served_weight_version(url, api_key=key, timeout_s=10.0)
        if served == target and (expected is None or fingerprint(url, key) == expected):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise SystemExit(f"the production server did not serve {target} within {timeout_s:.0f}s")


def flywheel(args: list[str], env: dict[str, str], *, ok: tuple[int, ...] = (0,)) -> str:
    """``flywheel ARGS`` in a subprocess; its stdout.

    Raises:
        SystemExit: the command exited with a code not in ``ok``.
    """
    proc = subprocess.run([sys.executable, "-m", "ops.cli", *args], env=env, text=True, capture_output=True)
    if proc.returncode not in ok:
        raise SystemExit(f"`flywheel {' '.join(args)}` exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 moves instead of 9")
    parser.add_argument("--moves", type=int, default=None, help="timed production changes (>= 5)")
    parser.add_argument("--home", default=None, help="FLYWHEEL_HOME to use (default: a new one)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    args = parser.parse_args()
    moves = max(5, args.moves or (5 if args.quick else 9))
    home = Path(args.home or tempfile.mkdtemp(prefix="flywheel-reload-")).resolve()
    os.environ["FLYWHEEL_HOME"] = str(home)
    os.environ["FLYWHEEL_API_PORT"] = str(os.environ.get("FLYWHEEL_API_PORT") or free_port())
    env = dict(os.environ)
    started = time.monotonic()
    try:
        state = stack_up(home)
        get_settings.cache_clear()
        upgrade(url=state.database_url)
        base_dir = init_base()
        store = CheckpointStore.from_settings()
        with tempfile.TemporaryDirectory() as tmp:
            register_model(
                perturbed_copy(base_dir, Path(tmp) / CANDIDATE), CANDIDATE, CheckpointStatus.CANDIDATE, source="bench"
            )

        state = StackState.load(home)
        settings = serving_settings(state)  # the keys the managed servers require
        key = settings.api_key.get_secret_value()  # the probes' inference key; the watcher reloads with the admin key
        t0 = time.monotonic()
        server = start_server("production", store.stable_path("base"), "base", home, settings=settings)
        cold_start_s = time.monotonic() - t0
        state.serving_urls = {"production": server.url}
        state.save(home)
        env["FLYWHEEL_SERVING_ENGINE"] = "vllm"
        env["FLYWHEEL_SERVING_URL"] = server.url
        env["FLYWHEEL_SERVING_API_KEY"] = key
        env["FLYWHEEL_SERVING_ADMIN_KEY"] = settings.admin_key.get_secret_value()
        prints = {"base": fingerprint(server.url, key)}

        services = {"api": ["api"], "relay": ["relay"], "watcher": ["watch"]}
        Supervisor(home, services, env).start()
        get_settings.cache_clear()
        api_url = f"http://127.0.0.1:{os.environ['FLYWHEEL_API_PORT']}"
        wait_http(f"{api_url}/healthz")
        token = flywheel(["tokens", "create", "--role", "release_manager", "--name", "bench-reload"], env)
        headers = {"Authorization": f"Bearer {token.strip().splitlines()[-1].strip()}"}
        gate_env = {**env, "FLYWHEEL_SERVING_ENGINE": "reference"}
        gate = ["gate", CANDIDATE, "--suite", "functions", "--gate-on", "functions", "--limit", "2"]
        # exit 1 is the gate's negative answer (insufficient evidence on two tasks): the promotion
        # below overrides it, audited
        flywheel(
            [*gate, "--min-pairs", "2", "--samples", "1", "--max-turns", "1", "--max-tokens", "16"], gate_env, ok=(0, 1)
        )

        timings: list[dict] = []
        with httpx.Client(base_url=f"{api_url}/v1", headers=headers, timeout=60.0) as client:
            production = "base"
            for i in range(moves):
                target = CANDIDATE if production == "base" else "base"
                body = {"checkpoint_id": target, "expected_production_id": production, "reason": REASON}
                if i == 0:
                    resp = client.post("/promotions", json={**body, "override_reason": REASON})
                else:
                    resp = client.post("/rollbacks", json=body)
                if resp.status_code >= 400:
                    raise SystemExit(f"move {i} to {target} refused: {resp.status_code} {resp.text[:500]}")
                t = wait_served(server.url, key, target, prints.get(target))
                prints.setdefault(target, fingerprint(server.url, key))
                timings.append({"to": target, "kind": "promotion" if i == 0 else "rollback", "s": round(t, 3)})
                production = target
        if prints["base"] == prints[CANDIDATE]:
            raise SystemExit("the two checkpoints answer the probe alike: the reload cannot be verified")
    finally:
        if not args.keep:
            stack_down(home)
    seconds = [t["s"] for t in timings]
    p50 = statistics.median(seconds)
    print(
        json.dumps(
            {
                "bench": "reload",
                "ours": round(p50, 3),
                "baseline": round(cold_start_s, 3),
                "unit": "s from the API's answer to the production server serving the new weights (p50)",
                "ratio": round(p50 / cold_start_s, 4),
                "target": f"p50 <= {TARGET_P50_S} s and <= {TARGET_COLD_RATIO} x cold start",
                "p50_s": round(p50, 3),
                "max_s": round(max(seconds), 3),
                "cold_start_s": round(cold_start_s, 3),
                "moves": timings,
                "wall_s": round(time.monotonic() - started),
                "pass": p50 <= TARGET_P50_S and p50 <= TARGET_COLD_RATIO * cold_start_s,
            }
        )
    )


if __name__ == "__main__":
    main()
