"""Repositories: queries and writes on one session. They ``flush``, never ``commit``; the boundary
(one HTTP request, one Kafka batch, one Celery task) owns the transaction."""
