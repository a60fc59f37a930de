"""SQLAlchemy 2 ORM models (``Mapped[]``). Importing this package registers every table."""

from app.models.ab import ABComparison
from app.models.base import Base
from app.models.canary import Canary
from app.models.checkpoints import Checkpoint, CheckpointTrajectory, TrainingCycle
from app.models.environments import TaskEnvironment
from app.models.evals import EvalResult, EvalRun, EvalShard, EvalTask, GateDecision
from app.models.events import ConsumerOffset, DeadLetter, EventArchive, EventLog, Outbox, PrivacyTombstone
from app.models.promotion import ApiToken, AuditLog, Promotion
from app.models.trajectories import ErasureRequest, RewardLabel, Trajectory, TrajectorySegment

__all__ = [
    "ABComparison",
    "Base",
    "Canary",
    "Checkpoint",
    "CheckpointTrajectory",
    "TrainingCycle",
    "EvalResult",
    "EvalRun",
    "EvalShard",
    "EvalTask",
    "TaskEnvironment",
    "GateDecision",
    "ConsumerOffset",
    "DeadLetter",
    "EventArchive",
    "EventLog",
    "Outbox",
    "PrivacyTombstone",
    "ApiToken",
    "AuditLog",
    "Promotion",
    "ErasureRequest",
    "RewardLabel",
    "Trajectory",
    "TrajectorySegment",
]
