"""Ranks that agree: every rank of a process group captures the same sizes and replays the same one.

Graphs with collectives inside pair up across ranks only if every rank captured the same sizes in
the same order and replays the same size at each call: a rank replaying its 8-row graph while
another replays its 4-row one issues collectives of different sizes, which hangs or corrupts.

* At capture (always, when the runner has a process group) every rank all-gathers the sizes it is
  about to capture, largest first, and every rank raises the same ``RankMismatchError`` naming the
  first rank that differs from rank 0, both lists and the first size that differs. This runs before
  any warm-up or capture, outside every graph.
* At every call (``check_ranks="every_call"``) every rank all-gathers the size it is about to
  replay (0 when it runs eagerly) before replaying, and raises ``RankMismatchError`` naming the
  ranks and sizes when they differ. With the default ``check_ranks="capture"`` the caller must give
  every rank the same batch at each call (tensor-parallel engines broadcast the batch to every
  rank), and nothing is exchanged per call.

The exchanges are ordinary collectives on the runner's group: a rank that never joins one (it
failed earlier, or fell back to eager before the check) makes the others fail after the group's
timeout (``init_process_group(timeout=...)``), which ``RankMismatchError`` reports; nothing waits
forever on gloo. (NCCL enforces its timeout through its watchdog.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from devgraph._errors import RankMismatchError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from devgraph.runner._config import RunnerConfig

__all__ = ["RankCheck", "capture_context", "check_capture", "resolve_group"]

#: ``process_group`` default: the default group when torch.distributed is initialised with >1 rank
AUTO = "auto"


def resolve_group(option: ProcessGroup | str | None) -> ProcessGroup | None:
    """The process group a runner checks ranks on: ``option`` itself, the default group for
    ``"auto"`` when torch.distributed is initialised with more than one rank, else None."""
    if not isinstance(option, str):
        return option  # a group, or None
    # ``"auto"``: ``RunnerConfig`` refuses any other string
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    group = torch.distributed.group.WORLD
    return group if torch.distributed.get_world_size(group) > 1 else None


class RankCheck:
    """The exchanges of one runner's ranks over ``group`` (tensors on ``device_type`` if the group
    has a backend for it, else on the CPU)."""

    def __init__(self, group: ProcessGroup, device_type: str, every_call: bool) -> None:
        dist = torch.distributed
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.every_call = every_call
        self.device = torch.device("cpu")
        if device_type != "cpu":
            try:
                group._get_backend(torch.device(device_type))
            except RuntimeError:
                pass  # no backend for that device in this group (gloo only): exchange on the CPU
            else:
                self.device = _current(device_type)

    def gather(self, values: Sequence[int], what: str) -> list[list[int]]:
        """Every rank's ``values`` (lists of any length), in rank order."""
        length = torch.tensor([len(values)], dtype=torch.int64, device=self.device)
        lengths = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self._all_gather(lengths, length, what)
        longest = int(lengths.max().item())
        mine = torch.zeros(longest, dtype=torch.int64, device=self.device)
        mine[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
        everyone = torch.empty(self.world * longest, dtype=torch.int64, device=self.device)
        if longest:
            self._all_gather(everyone, mine, what)
        rows = everyone.view(self.world, longest).tolist() if longest else [[] for _ in range(self.world)]
        return [row[:n] for row, n in zip(rows, lengths.tolist())]

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        dist = torch.distributed
        # torch 2.13 names it all_gather_single (all_gather_into_tensor warns); older torch lacks it.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        try:
            gather(out, inp, group=self.group)
        except RuntimeError as err:
            raise RankMismatchError(
                f"rank {self.rank} of {self.world}: the exchange of {what} failed ({err}); another rank "
                "did not join it within the process group's timeout: it failed before (see its log), "
                "captured on another schedule, or ran this call eagerly"
            ) from err

    def agree_on_sizes(
        self, sizes: Sequence[int], noun: str = "batch sizes", options: str = "batch_sizes/max_batch_size"
    ) -> None:
        """Raise ``RankMismatchError`` unless every rank captures ``sizes`` (in this order).

        ``noun`` names the sizes in the message, ``options`` the runner options that set them.
        """
        table = self.gather(sizes, "capture sizes")
        differing = [r for r, theirs in enumerate(table) if theirs != table[0]]
        if not differing:
            return
        r = differing[0]
        first = min(set(table[r]) ^ set(table[0]), default=None)
        if first is None:  # the same sizes, a different count or order
            first = next(a if a is not None else b for a, b in _zip_longest(table[r], table[0]) if a != b)
        raise RankMismatchError(
            f"rank {r} of {self.world} captures {noun} {sorted(table[r])} but rank 0 captures "
            f"{sorted(table[0])}: size {first} differs; give every rank the same {options}",
            sizes={rank: list(s) for rank, s in enumerate(table)},
        )

    def agree_on_call(self, size: int | None) -> None:
        """Raise ``RankMismatchError`` unless every rank replays ``size`` (None: runs eagerly) now."""
        mine = torch.tensor([size or 0], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self._all_gather(everyone, mine, "this call's graph size")  # one collective per call
        table = everyone.tolist()
        if all(s == table[0] for s in table):
            return
        shown = ", ".join(f"rank {r}: {_size(s)}" for r, s in enumerate(table))
        raise RankMismatchError(
            f"rank {self.rank} of {self.world}: the ranks would replay different graphs for this call "
            f"({shown}); their collectives would not pair up. Give every rank a batch of the same size "
            "at each call",
            sizes={r: [s] for r, s in enumerate(table)},
        )


def _size(s: int) -> str:
    return f"batch size {s}" if s else "eager (no graph)"


def _zip_longest(a: Sequence[int], b: Sequence[int]) -> list[tuple[int | None, int | None]]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else None, b[i] if i < len(b) else None) for i in range(n)]


def _current(device_type: str) -> torch.device:
    module = getattr(torch, device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else None
    return torch.device(device_type, index) if index is not None else torch.device(device_type)


def check_capture(
    config: RunnerConfig, device_type: str, sizes: Sequence[int], noun: str, options: str
) -> RankCheck | None:
    """Before a runner captures ``sizes`` (largest first): agree on them with the other ranks.

    ``noun`` and ``options`` name the sizes and the options that set them in the error.
    Returns the per-call check for ``_serve`` (``check_ranks="every_call"``), or None.
    """
    group = resolve_group(config.process_group)
    if group is None:
        return None
    check = RankCheck(group, device_type, config.check_ranks == "every_call")
    check.agree_on_sizes(sorted(sizes, reverse=True), noun, options)
    return check if check.every_call else None


def capture_context(config: RunnerConfig) -> contextlib.AbstractContextManager[Any]:
    """The caller's ``capture_context()`` (an engine's collective set-up), or nothing."""
    return config.capture_context() if config.capture_context is not None else contextlib.nullcontext()
