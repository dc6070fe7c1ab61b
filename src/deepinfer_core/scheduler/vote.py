"""How the ranks of one DP group agree on the next step type (a NORMAL engine never mixes prefill and
decode in one step). Each rank states (has prefill work it can start, has decode work); the group's
answer is (all ranks have prefill work, any rank has prefill work, any rank has decode work). Every
rank then derives the same step type from the same answer and the same decode-step counter.
"""

from __future__ import annotations

from typing import Any


class LocalVote:
    """A group of one rank: the answer is the rank's own wish."""

    def decide(self, has_prefill: bool, has_decode: bool) -> tuple[bool, bool, bool]:
        return (bool(has_prefill), bool(has_prefill), bool(has_decode))


class DistributedVote:
    """One all-reduce (MAX) over the DP group of three flags: has_prefill, NOT has_prefill, has_decode.

    MAX of "not has_prefill" is "some rank lacks prefill work", so all ranks having it is its negation;
    one collective answers all three questions. Works with gloo (CPU) and NCCL (pass ``device``).
    """

    def __init__(self, group: Any = None, device: Any = "cpu") -> None:
        import torch.distributed as dist  # only this class needs torch

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedVote: torch.distributed must be initialised before use")
        self._dist = dist
        self.group = group
        self.device = device

    def decide(self, has_prefill: bool, has_decode: bool) -> tuple[bool, bool, bool]:
        import torch

        flags = torch.tensor(
            [int(has_prefill), int(not has_prefill), int(has_decode)], dtype=torch.int32, device=self.device
        )
        self._dist.all_reduce(flags, op=self._dist.ReduceOp.MAX, group=self.group)
        some_lack, any_prefill, any_decode = bool(flags[1]), bool(flags[0]), bool(flags[2])
        return (not some_lack, any_prefill, any_decode)
