"""Triton kernels with torch reference fallbacks (used on CPU)."""
