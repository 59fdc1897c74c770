"""Run a function on N spawned processes that form a ``torch.distributed`` group, with no hangs.

``run_ranks(fn, world_size)`` spawns ``world_size`` fresh Python processes, joins them into one
process group (gloo on CPU by default, through a ``FileStore`` in a temporary folder: no ports),
calls ``fn(rank, world_size, *args)`` on each, and returns the ranks' return values in rank order.

Every wait is bounded: the process group gets ``pg_timeout`` seconds (so a collective that a peer
never joins raises on the waiting rank instead of blocking), and the whole run gets ``timeout``
seconds, after which every rank still alive is killed and ``RanksTimedOut`` is raised. A rank that
raises makes ``run_ranks`` raise ``RanksFailed`` carrying every rank's error and traceback.

``fn`` must be picklable by reference (a module-level function) and so must ``args`` and the
return values. The children import ``fn``'s module afresh (spawn), with the parent's ``sys.path``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["RanksFailed", "RanksTimedOut", "run_ranks"]


class RanksFailed(AssertionError):
    """One or more ranks raised; ``errors`` maps rank -> (exception type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]) -> None:
        self.errors = errors
        parts = [f"rank {r} raised {name}: {msg}\n{tb}" for r, (name, msg, tb) in sorted(errors.items())]
        super().__init__(f"{len(errors)} rank(s) failed:\n" + "\n".join(parts))


class RanksTimedOut(AssertionError):
    """The run went past its timeout; the ranks still running were killed."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks of one process group.

    Returns the return values in rank order. Raises ``RanksFailed`` if any rank raised (after the
    other ranks finished or ``timeout`` passed) and ``RanksTimedOut`` if a rank was still running at
    ``timeout`` seconds (it is killed). ``env`` adds environment variables for the children.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="devgraph-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = []
        for rank in range(world_size):
            out = os.path.join(tmp, f"rank{rank}.pkl")
            p = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, tuple(args), store, out, backend, pg_timeout, timeout, env or {}),
                name=f"devgraph-rank{rank}",
            )
            p.start()
            procs.append((p, out))
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and any(p.is_alive() for p, _ in procs):
                time.sleep(0.05)
            alive = [rank for rank, (p, _) in enumerate(procs) if p.is_alive()]
        finally:
            for p, _ in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
        results: list[Any] = []
        errors: dict[int, tuple[str, str, str]] = {}
        for rank, (p, out) in enumerate(procs):
            if not os.path.exists(out):
                if rank not in alive:
                    errors[rank] = ("ProcessDied", f"exit code {p.exitcode}, no result written", "")
                results.append(None)
                continue
            with open(out, "rb") as f:
                status, payload = pickle.load(f)
            if status == "ok":
                results.append(payload)
            else:
                errors[rank] = payload
                results.append(None)
        if alive:
            done = {r: e for r, e in errors.items()}
            raise RanksTimedOut(
                f"ranks {alive} of {world_size} still running after {timeout:g}s and were killed"
                + (f"; other ranks failed first: {RanksFailed(done)}" if done else "")
            )
        if errors:
            raise RanksFailed(errors)
        return results


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    store_path: str,
    out: str,
    backend: str,
    pg_timeout: float,
    start_timeout: float,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    result: tuple[str, Any]
    try:
        import torch
        import torch.distributed as dist

        # One intra-op thread per rank: several ranks share few cores in tests.
        torch.set_num_threads(int(os.environ.get("DEVGRAPH_TEST_THREADS", "1")))
        store = dist.FileStore(store_path, world_size)
        _wait_for_every_rank(store, rank, world_size, start_timeout, "started")
        store.set_timeout(timedelta(seconds=pg_timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
        # A rank that returned from fn and destroyed its group while a slower peer was still
        # connecting closed that peer's connection under it (gloo's connectFullMesh, on a loaded
        # machine): fn starts once every rank's group is connected.
        _wait_for_every_rank(store, rank, world_size, start_timeout, "connected")
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which re-raises
        result = ("err", (type(e).__name__, str(e), traceback.format_exc()))
    try:
        data = pickle.dumps(result)
    except Exception as e:  # an unpicklable result is the caller's bug; say so
        data = pickle.dumps(("err", (type(e).__name__, f"result not picklable: {e}", "")))
    with open(out + ".tmp", "wb") as f:
        f.write(data)
    os.replace(out + ".tmp", out)


def _wait_for_every_rank(store: Any, rank: int, world_size: int, timeout: float, stage: str) -> None:
    """Return once every rank has reached ``stage`` ("started": imported torch; "connected": made its
    process group), or raise after ``timeout`` seconds.

    On a loaded machine starting a rank alone (spawn, ``import torch``) can take longer than the
    group's timeout, which should bound collectives, not start-up: the group is made only once
    every rank is here.
    """
    previous = store.timeout
    store.set_timeout(timedelta(seconds=timeout))
    key = f"devgraph/{stage}"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {arrived} of {world_size} ranks {stage} within {timeout:g}s")
        time.sleep(0.02)
        arrived = store.add(key, 0)
    store.set_timeout(previous)
