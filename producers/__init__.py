"""The producer SDK the product backend embeds: the event contract (``producers.events``), the
:class:`~producers.producer.EventProducer` (typed envelopes keyed by session, W3C trace headers,
a disk spool while the broker is away) and its settings. It imports nothing from the service and
installs alone (``pip install ./producers``): no torch, no SQLAlchemy."""
