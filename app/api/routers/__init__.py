"""The API's routers, one per resource family, all mounted under ``/v1`` (health at the root)."""
