"""Test-environment shim: make the registry's CUDA-only torchvision wheel importable on CPU torch.

SGLang 0.5.23 imports torchvision unconditionally, and the only torchvision 0.28 wheel on the registry
is a CUDA build whose ``_C.so`` cannot load next to the CPU torch the tests pin. torchvision then
fails at import in ``_meta_registrations`` (``register_fake`` of ``torchvision::nms`` and ``::qnms``, ops that were
never defined). ``nox -s tests-sglang`` installs this module with a ``.pth`` line; when torchvision is
imported it defines those two schemas (no kernel: calling it raises), which is all that
import needs. Nothing of torch, torchvision or SGLang is patched; devgraph itself never ships this.
"""

from __future__ import annotations

import importlib.abc
import sys


class _DefineNmsSchema(importlib.abc.MetaPathFinder):
    """Defines torchvision::nms and ::qnms just before torchvision's meta registrations run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision._meta_registrations":
            return None
        import torch

        global _LIB
        for name in ("nms", "qnms"):
            if not hasattr(torch.ops.torchvision, name):
                # Kept alive on the module: a schema lives as long as its Library object.
                _LIB = _LIB or torch.library.Library("torchvision", "FRAGMENT")
                _LIB.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


_LIB = None


def install() -> None:
    """Adds the finder once (called from the .pth line at interpreter start)."""
    if not any(isinstance(f, _DefineNmsSchema) for f in sys.meta_path):
        sys.meta_path.insert(0, _DefineNmsSchema())
