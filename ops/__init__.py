"""Operations: the local embedded stack, the Celery app and schedule, serving, deploy files."""
