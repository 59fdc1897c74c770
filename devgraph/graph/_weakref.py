"""Non-owning tensors: views of memory that do not keep it alive (vLLM's ``weak_ref_tensors``).

Built with PyTorch's Python-level storage-from-data-pointer constructor (the one cudagraph trees
use), so no C++ extension is needed and it works for every device type.
"""

from __future__ import annotations

from typing import Any

__all__ = ["weak_ref_tensor", "weak_ref_tensors"]


def weak_ref_tensor(tensor: Any) -> Any:
    """A tensor over ``tensor``'s memory that does not keep that memory alive.

    The caller keeps the memory alive by other means (for captured outputs: the graph's pool). It
    is an ordinary tensor even when made under ``torch.inference_mode``: a graph's outputs are handed
    to callers in any mode, and an inference tensor could not be written in place, or saved for
    backward, outside inference mode (where eager's outputs can).

    Raises:
        TypeError: ``tensor`` is not a tensor.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weak_ref_tensor expects a tensor, got {type(tensor).__name__}")
    storage = tensor.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    with torch.inference_mode(False):
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
            weak, tensor.storage_offset(), tensor.shape, tensor.stride()
        )


def weak_ref_tensors(tensors: Any) -> Any:
    """``weak_ref_tensor`` applied to every tensor in a (nested) list/tuple/dict; others pass through."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: weak_ref_tensor(t) if isinstance(t, torch.Tensor) else t, tensors)
