"""A checkpoint's life, owned here and nowhere else: who may change its status, and where.

Every write that changes a checkpoint's life is a function of this package; each takes the
caller's session, flushes and never commits (the boundary commits: an HTTP request, a CLI
command, a Celery task, a Kafka batch), and writes its audit row (``app.repositories.audit``) and
its typed lifecycle message (:mod:`app.lifecycle.messages`, through ``app.outbox.lifecycle``) in
that same transaction. ``checkpoint.status`` moves only along :data:`app.lifecycle.status.TRANSITIONS`.

==========================  ===========================================  ==========================
change                      function                                     called by
==========================  ===========================================  ==========================
candidate registered        ``registration.register_candidate``          ``trainer.records``
model registered by hand    ``registration.register_model``              ``app.checkpoints.publish``
gated                       ``gating.record_gate_decision``              ``evals.gating``
promoted                    ``changes.promote_checkpoint``               ``app.promotion.service``
                                                                         (API, CLI), ``release``
rolled back                 ``changes.rollback_production``              ``app.promotion.service``,
                                                                         ``erasure``
rejected                    ``changes.reject_checkpoint``                ``app.promotion.service``
canary started / stopped    ``canary.start_canary`` / ``stop_canary``    API, CLI,
                                                                         ``app.promotion.canary_policy``
canary ended by a change    ``canary.end_canary_for_change``             ``changes``
flagged by erasure          ``erasure.flag_subtrees``,                   ``consumers.erasure``,
                            ``registration.inherit_parent_flag``         ``trainer.records``
released by policy          ``release.apply_release_policy``             ``evals.automation``
==========================  ===========================================  ==========================

Rooms, bottom up (contract "Lifecycle rooms point down" in pyproject.toml): ``status``,
``messages``, ``assignment``, ``serving_state``, ``online_stats`` (leaves) < ``production`` (the
locks and the rows every change reads first), ``online`` < ``canary`` < ``changes`` < ``erasure``,
``gating`` < ``registration``, ``release``. Processes (consumers, trainer, evals, serving, ops)
import this package, never ``app.promotion`` (a forbidden contract).
"""
