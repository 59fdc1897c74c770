"""What a runner part is: ``Part`` (which graphs serve a call), ``Words`` (how it is named in
messages; ``_config.py``) and ``Kit`` (what the runner lends every part: one set of static inputs, one
capture loop, one set of accounts).

A part only answers "which graphs": it captures its sizes from an example call, replays a loaded call at
a bucket, cuts the outputs to the call's rows, and says what happens to a call beyond its sizes. Reading,
matching, bucketing, loading and counting are the runner's (``_runner.py``), once for every part.

Adding a part: a module with a class that takes a ``Kit`` and satisfies ``Part``, and its name in
``PARTS`` (``_runner.py``) and ``MODE_TABLE`` (``_config.py``); or, without touching devgraph, pass its
class to ``GraphRunner(part=...)`` (``tests/runner/test_toy_part.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs

from devgraph.graph import Device, SharedPool
from devgraph.runner._accounts import Accounts
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._capture_loop import CaptureLoop
from devgraph.runner._config import RunnerConfig, RunnerStats, Words
from devgraph.runner._inputs import StaticInputs

__all__ = ["Kit", "Part", "Words"]


@attrs.frozen
class Kit:
    """What a runner lends each of its parts: the model, the device, the config, the pool and side
    stream every capture shares, the lock the counters are kept under, and the one ``StaticInputs``,
    ``Accounts`` and ``CaptureLoop`` every part of the runner uses."""

    fn: Callable[..., Any]
    device: Device
    config: RunnerConfig
    shared: SharedPool
    lock: threading.RLock
    inputs: StaticInputs
    accounts: Accounts
    loop: CaptureLoop


class Part(Protocol):
    """Which graphs serve a runner's calls: what the one call path (``GraphRunner.serve``) needs of them.

    ``sizes``: the sizes asked for; ``buckets``: the sizes a call is bucketed into, None before a
    capture (the runner captures on the first call), empty when none was captured; ``exact_only``: why
    a call padded up to a bucket would differ from eager (None: padding is exact). ``capture`` captures
    every size from one example call (the runner's inputs hold static buffers of enough rows);
    ``replay`` replays a loaded call at bucket ``size``; ``cut`` cuts its outputs to the call's rows;
    ``beyond`` serves a call no bucket can (raise the ``Unsupported`` for an eager run, or serve it
    another way); ``drop`` forgets the graphs (the runner forgets the inputs).
    """

    words: Words
    sizes: list[int]
    buckets: list[int] | None
    exact_only: str | None

    @property
    def stats(self) -> RunnerStats: ...

    def capture(self, example: Call) -> None: ...

    def replay(self, call: Call, size: int, host_args: Mapping[str, Any] | None) -> Any: ...

    def cut(self, outputs: Any, size: int, batch: int) -> Any: ...

    def beyond(self, call: Call, why: Unsupported) -> Any: ...

    def drop(self) -> None: ...
