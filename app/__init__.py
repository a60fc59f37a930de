"""flywheel's shared core and promotion API.

The shared core (``app.core``, ``producers.events``, ``app.models``, ``app.repositories``) never imports
FastAPI, torch or Celery, so every process (consumers, trainer, evals, API) can depend on it.
"""
