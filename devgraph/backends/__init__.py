"""Built-in backends: cpu (reference simulator), cuda, npu.

Each registers through the ``devgraph`` entry-point group exactly like a third-party plugin.
Importing a submodule of this package makes Python bind ``devgraph.backends`` to this package,
shadowing the public function ``devgraph.backends()``; the package is therefore callable and
forwards to that function, so both spellings keep working.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self) -> Any:
        from devgraph._plugins import backends

        return backends()


sys.modules[__name__].__class__ = _CallablePackage
