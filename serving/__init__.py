"""Inference: one engine interface, a vLLM HTTP client and an in-process torch engine."""
