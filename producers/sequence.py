"""Per-session sequence numbers the producer SDK stamps on events (``EventBase.seq``).

Invariant: within one producer, the events of a session that the caller did not number get
``seq`` 0, 1, 2, ... in the order ``emit`` took them, so a consumer can tell a session that lost
events (a gap, or no 0) from a complete one. An event the caller numbered keeps its ``seq``.

Limits: the counters live in memory. A session's counter is dropped at its ``session.ended``, and
the least recently used one past ``max_sessions``; a session emitted from two producers, or
resumed after a restart, numbers from 0 again, and an event emitted twice (not in a row) takes
two numbers, one of which the consumer never stores (a false gap). Numbers that repeat never make a session look
incomplete (the consumer counts the numbers it saw against the highest), they only hide a gap.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from uuid import UUID

from producers.events.types import EventBase

DEFAULT_MAX_SESSIONS = 100_000
"""Sessions whose counters one producer keeps (about 100 bytes each)."""


class SessionSequencer:
    """Stamps ``seq`` on events, per session; thread-safe."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[int, UUID | None]] = OrderedDict()
        """session id -> (its next seq, the event id that took the one before)"""
        self._lock = threading.Lock()

    def stamp(self, event: EventBase) -> EventBase:
        """``event`` with its session's next ``seq`` (itself if it has one already; the same ``seq``
        again for the event just stamped, emitted twice in a row)."""
        if event.seq is not None:
            return event
        sid = event.session_id
        with self._lock:
            n, last = self._sessions.pop(sid, (0, None))
            if last == event.event_id:
                n -= 1
            if event.type != "session.ended":
                self._sessions[sid] = (n + 1, event.event_id)
                if len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
        return event.model_copy(update={"seq": n})

    def release(self, event: EventBase) -> None:
        """Give back the ``seq`` :meth:`stamp` just gave ``event`` (the event was refused, not
        emitted), if its session has numbered nothing since."""
        if event.seq is None:
            return
        with self._lock:
            if self._sessions.get(event.session_id, (None, None)) == (event.seq + 1, event.event_id):
                self._sessions[event.session_id] = (event.seq, None)
