"""``ThreadOwner``: the one live thread a runner serves while its outputs are views of graph memory."""

from __future__ import annotations

import threading

from devgraph._errors import DevgraphError
from devgraph.runner._config import RunnerConfig

__all__ = ["ThreadOwner"]


class ThreadOwner:
    """The thread a runner serves (``claim``, under the runner's lock).

    Outputs are views of graph memory that the next replay overwrites. The lock serialises calls,
    but a thread reads its outputs after the lock is released; if another thread's call replayed
    in between, it would read that call's result. So without ``clone_outputs`` one live thread at a
    time uses a runner: a call from a second one is refused while the first is alive. With
    ``clone_outputs=True`` outputs are copied under the lock and any thread may call.
    ``caller_serialises``: the caller consumes every output under a lock of its own before any
    other call (the Hugging Face adapter's ``generate``).
    """

    def __init__(self, config: RunnerConfig, caller_serialises: bool) -> None:
        self.free = config.clone_outputs or caller_serialises
        # The thread whose outputs are views of graph memory; None: nobody's yet.
        self.owner: threading.Thread | None = None

    def claim(self) -> None:
        """Make the calling thread the one served, or refuse it.

        Raises:
            DevgraphError: another live thread holds outputs that are views of graph memory.
        """
        if self.free:
            return
        me, owner = threading.current_thread(), self.owner
        if owner is None or owner is me or not owner.is_alive():
            self.owner = me
            return
        raise DevgraphError(
            f"this graphed model is already used by thread {owner.name!r}, and its outputs are views of "
            "graph memory that the next call overwrites: a call from this thread "
            f"({me.name!r}) would replace the result {owner.name!r} is reading. Wrap with "
            "clone_outputs=True to call it from several threads (each call then returns its own copy), "
            "or wrap the model once per thread"
        )
