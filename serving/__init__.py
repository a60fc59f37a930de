"""Serving: vLLM over its HTTP API (the production engine), the in-process reference engine for tests
and hosts without vLLM, the watcher that follows production, canaries and the serving front."""
