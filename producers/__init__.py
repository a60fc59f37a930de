"""What the product backend embeds: the event producer SDK (light: no torch, no SQLAlchemy),
plus the outbox relay and the editor simulator."""
