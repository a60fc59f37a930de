"""The promotion API (FastAPI). Only this package and ``app.promotion`` import FastAPI."""
