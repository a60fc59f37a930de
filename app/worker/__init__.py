"""The Celery app every area's tasks register on, and its beat schedule."""
