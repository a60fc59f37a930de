"""The transactional outbox: lifecycle messages written in the same transaction as the change they
announce (``lifecycle``) and the relay that publishes them to the lifecycle topic (``relay``)."""
