"""Ascend capture failures with known causes, and the remedy each names.

ACL graph capture fails in two ways with one cure each (vllm-ascend's acl_graph.py classifies the
same two by the same markers):

* the device ran out of hardware streams: ``error code is 207008`` / ``Stream resources are
  insufficient`` / ``Insufficient_Stream_Resources``. Every captured piece costs streams, so capture
  fewer sizes, or only full decode graphs (vLLM's ``FULL_DECODE_ONLY``).
* the Ascend driver (HDK) is older than CANN needs: ``Alloc sq cq fail``. Upgrade the HDK.

``classify`` turns the runtime's exception into a ``CaptureError`` naming the cause and the remedy; any
other exception is left alone.
"""

from __future__ import annotations

from devgraph._errors import CaptureError

__all__ = ["OLD_DRIVER_MARKERS", "STREAM_MARKERS", "classify"]

#: Lower-case markers of a capture that ran out of hardware streams.
STREAM_MARKERS = ("207008", "stream resources are insufficient", "insufficient_stream_resources")
#: Lower-case markers of an Ascend driver (HDK) too old for the CANN stack.
OLD_DRIVER_MARKERS = ("alloc sq cq fail",)

STREAM_REMEDY = (
    "capture fewer sizes: pass capture_sizes=[...] (or a smaller list of batch sizes), or lower the "
    "per-stack cap DEVGRAPH_NPU_MAX_CAPTURE_SIZES / the stream budget DEVGRAPH_NPU_STREAMS; or capture "
    "only full decode graphs (mode='full' instead of piecewise; vLLM: cudagraph_mode=FULL_DECODE_ONLY). "
    "Other processes holding streams on this NPU count too"
)
OLD_DRIVER_REMEDY = (
    "the Ascend driver (HDK) is older than this CANN stack needs: upgrade the HDK (25.5.1 or later) to "
    "match CANN, or use the CANN version your driver supports"
)


def classify(exc: BaseException) -> CaptureError | None:
    """A ``CaptureError`` for a capture failure with a known cause, or None."""
    if isinstance(exc, CaptureError):
        return None
    text = str(exc).lower()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if any(m in text for m in OLD_DRIVER_MARKERS):
        return CaptureError(
            f"ACL graph capture failed: the driver could not allocate a stream queue ({first})",
            op="aclmdlRICaptureBegin",
            remedy=OLD_DRIVER_REMEDY,
        )
    if any(m in text for m in STREAM_MARKERS):
        return CaptureError(
            f"ACL graph capture failed: the NPU's stream resources are insufficient ({first})",
            op="aclmdlRICaptureBegin",
            remedy=STREAM_REMEDY,
        )
    return None
