"""The scheduler's concrete classes satisfy their protocols (runtime isinstance)."""

from __future__ import annotations

from deepinfer_core.kv import PagedKVPool
from deepinfer_core.protocols import Scheduler as SchedulerProtocol
from deepinfer_core.protocols import StepVote
from deepinfer_core.scheduler import LocalVote, Scheduler


def test_scheduler_satisfies_protocol() -> None:
    assert isinstance(Scheduler(PagedKVPool(16, 4)), SchedulerProtocol)


def test_votes_satisfy_protocol() -> None:
    assert isinstance(LocalVote(), StepVote)
    # DistributedVote needs an initialised process group; its class must still carry the method.
    from deepinfer_core.scheduler import DistributedVote

    assert callable(DistributedVote.decide)


def test_protocol_rejects_an_incomplete_scheduler() -> None:
    class Half:
        def schedule(self) -> None: ...

    assert not isinstance(Half(), SchedulerProtocol)
