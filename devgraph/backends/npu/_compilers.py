"""The NPU backend's compiler of pieces: ``torchair`` (contributed through ``devgraph_register_compilers``).

torchair ships with torch_npu and compiles for Ascend NPUs; it is named here, by the NPU backend, so
the compiler core never checks which device it runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from devgraph._errors import DevgraphError

__all__ = ["torchair"]


def torchair(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    try:
        import torchair  # type: ignore[import-not-found]
    except ImportError as exc:
        raise DevgraphError(
            f"compile_backend='torchair' needs torchair, which cannot be imported here ({exc}); it ships "
            "with torch_npu (or `pip install torchair`) and needs an Ascend NPU. Use compile_backend='eager' "
            "to run the pieces uncompiled."
        ) from None
    # Every piece is captured into (and replayed from) an ACL graph. No torchair mode runs inside a
    # capture it does not own: max-autotune runs a GE graph through GE's executor, reduce-overhead and
    # npugraph_ex capture ACL graphs of their own; vllm-ascend treats torchair graph mode and ACL graph
    # capture as exclusive. Refuse instead of failing (or mis-capturing) on hardware.
    raise DevgraphError(
        f"compile_backend='torchair' (torchair {getattr(torchair, '__version__', '?')}) cannot compile "
        "pieces that devgraph captures into ACL graphs: none of torchair's modes (max-autotune, "
        "reduce-overhead, npugraph_ex) may run inside another capture. Use compile_backend='eager' "
        "(the npu default), or run the model under torchair alone, without devgraph's graphs"
    )
