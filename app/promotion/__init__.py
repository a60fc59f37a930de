"""What the API and the CLI call to change a checkpoint's life, above the owner of that life.

``app.lifecycle`` owns a checkpoint's statuses and transitions (every write, its audit row and its
lifecycle message); this package holds the API-facing side: the traced entry points of promote,
roll back and reject (``service``, each one change of ``app.lifecycle.changes``), the online canary
policy (``canary_policy``), the API's read models (``queries``) and their Celery tasks (``tasks``).
Processes (consumers, trainer, evals, serving, ops) never import it (a forbidden contract).
"""
