"""The checkpoint look-ups every process shares: a missing production checkpoint is one clear
ConfigurationError that says what to do, wherever it is asked for (the gate, the floors CLI, the
serving engine)."""

from __future__ import annotations

import pytest

from app.core.errors import ConfigurationError
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint, require_production

pytestmark = pytest.mark.integration


def test_require_production_names_the_fix_and_finds_production(session):
    with pytest.raises(ConfigurationError, match=r"^no production checkpoint: run `flywheel model init` first$"):
        require_production(session)
    with pytest.raises(ConfigurationError, match="no production checkpoint: name one with --checkpoint"):
        require_production(session, "name one with --checkpoint")
    add_checkpoint(session, checkpoint_id="base", path="/x/base", status=CheckpointStatus.PRODUCTION)
    add_checkpoint(session, checkpoint_id="cand", path="/x/cand", parent_id="base", generation=1)
    session.flush()
    assert require_production(session).id == "base"
