"""Test support for serving: an ASGI app served from a thread on a free port."""

from __future__ import annotations

import threading
import time

import uvicorn

from app.core.net import free_port


def serve_in_thread(app, timeout_s: float = 20.0):
    """Run ASGI ``app`` with uvicorn on a free 127.0.0.1 port in a daemon thread (tests).

    Returns:
        ``(base_url, server, thread)``; set ``server.should_exit = True`` to stop it.

    Raises:
        TimeoutError: uvicorn did not start within ``timeout_s`` seconds.
    """
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread
