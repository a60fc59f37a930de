"""Promotion, rollback and rejection of checkpoints: the transactions behind the API."""
