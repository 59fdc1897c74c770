"""Graph passes over the aten-level FX graph, run by ``PassManager`` before the split.

Built-in fusions (default order): ``split_qkv_rms_norm_rope``, ``add_rms_norm_quant``,
``add_rms_norm_dynamic_quant``, ``add_rms_norm``. Each rewrites matches into one devgraph op
(cpu reference, cuda and PrivateUse1 kernels, and a fake impl for tracing). Backends add their
own through the ``devgraph_register_passes(register, device)`` hook.
"""

from devgraph.compile.passes._base import Pass, PassContext, PassManager
from devgraph.compile.passes._match import RmsMatch, match_rms_norm
from devgraph.compile.passes._norm import (
    AddRmsNormDynamicQuantFusion,
    AddRmsNormFusion,
    AddRmsNormQuantFusion,
)
from devgraph.compile.passes._qkv import SplitQkvRmsNormRopeFusion
from devgraph.compile.passes._registry import builtin_passes, contributed_passes, resolve_passes

__all__ = [
    "AddRmsNormDynamicQuantFusion",
    "AddRmsNormFusion",
    "AddRmsNormQuantFusion",
    "Pass",
    "PassContext",
    "PassManager",
    "RmsMatch",
    "SplitQkvRmsNormRopeFusion",
    "builtin_passes",
    "contributed_passes",
    "match_rms_norm",
    "resolve_passes",
]
