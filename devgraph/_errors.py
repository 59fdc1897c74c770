"""Every error devgraph raises, in one module."""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "CaptureError",
    "DevgraphError",
    "PluginLoadError",
    "RankMismatchError",
]


class DevgraphError(RuntimeError):
    """Base class of every devgraph error."""


class BackendUnavailable(DevgraphError):
    """A backend was asked for but cannot run here; ``reason`` says why."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"devgraph backend {name!r} is unavailable: {reason}")


class PluginLoadError(DevgraphError):
    """A plugin registered under the ``devgraph`` entry-point group failed to load."""

    def __init__(self, plugin: str, cause: BaseException) -> None:
        self.plugin = plugin
        self.cause = cause
        super().__init__(
            f"devgraph plugin {plugin!r} failed to load: {type(cause).__name__}: {cause}. "
            "Fix or uninstall that package, or set DEVGRAPH_AUTOLOAD=0 to skip third-party "
            "plugins (the built-in cpu/cuda/npu backends still load)."
        )


class CaptureError(DevgraphError):
    """Something in the captured region cannot be recorded into a graph.

    Attributes:
        op: the operation that was refused (``"aten::_local_scalar_dense"``, ``"Tensor.item"``...).
        source: the user's source line that issued it (``"model.py:42: n = x.sum().item()"``).
        remedy: what to do about it.
        batch_size: the capture size it happened at, when a runner was capturing buckets.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        source: str | None = None,
        remedy: str | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.message = message
        self.op = op
        self.source = source
        self.remedy = remedy
        self.batch_size = batch_size
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.message]
        if self.op:
            parts.append(f"op: {self.op}")
        if self.source:
            parts.append(f"at: {self.source}")
        if self.batch_size is not None:
            parts.append(f"while capturing batch size {self.batch_size}")
        if self.remedy:
            parts.append(f"remedy: {self.remedy}")
        return "\n  ".join(parts)

    def with_batch_size(self, batch_size: int, remedy: str | None = None) -> CaptureError:
        """Return a copy that also names the capture size (and optionally a better remedy)."""
        err = CaptureError(
            self.message,
            op=self.op,
            source=self.source,
            remedy=remedy or self.remedy,
            batch_size=batch_size,
        )
        err.__cause__ = self.__cause__
        return err


class RankMismatchError(DevgraphError):
    """The ranks of a process group disagree on the graphs they capture or replay.

    Raised on every rank (the same message on each) when the ranks' capture sizes differ, or, with
    ``check_ranks="every_call"``, when they would replay different sizes for one call; also when a
    rank did not join the exchange within the process group's timeout.

    Attributes:
        sizes: rank -> the sizes that rank reported (empty when the exchange itself failed).
    """

    def __init__(self, message: str, *, sizes: dict[int, list[int]] | None = None) -> None:
        self.sizes = sizes or {}
        super().__init__(message)
