"""Tensor-parallel pieces of the tiny decoder: the rank's shard, its collectives, vocab-parallel layers.

Megatron/vLLM layout on ``world_size`` ranks of one process group:

* **vocab-parallel embedding**: rank ``r`` holds rows ``[r * V/n, (r+1) * V/n)`` of the embedding;
  a token outside its range looks up row 0 and is zeroed (a masked lookup), and an all-reduce sums
  the one rank's row with the others' zeros;
* **column-parallel** QKV and gate/up projections: each rank holds its heads (``num_heads/n`` query,
  ``num_kv_heads/n`` key/value heads, so a rank's query heads use its own key/value heads) and its
  slice of the intermediate size; no collective;
* **row-parallel** o_proj and down projections: the matching input columns; their partial sums are
  all-reduced;
* **vocab-parallel logits**: each rank computes the logits of its vocabulary rows; an all-gather
  concatenates them.

Collectives go through ``torch.distributed`` on the shard's group, in one of two styles that
engines use: ``"inplace"`` (``dist.all_reduce(t)``, ``dist.all_gather_single``, named
``all_gather_into_tensor`` before torch 2.13: vLLM's communicator) or ``"functional"``
(``torch.distributed._functional_collectives``: what Dynamo traces in-place collectives into, and
what torch's own tensor parallelism uses).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "COLLECTIVE_STYLES",
    "ParallelLMHead",
    "TensorParallel",
    "VocabParallelEmbedding",
    "shard_state_dict",
]


class LayerSizes(Protocol):
    """The sizes ``shard_state_dict`` splits by (``devgraph.testing.models.DecoderConfig`` has them)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


#: How the model issues its collectives (see the module docstring).
COLLECTIVE_STYLES = ("inplace", "functional")


def _style(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in COLLECTIVE_STYLES:
        raise ValueError(f"TensorParallel.collectives must be one of {COLLECTIVE_STYLES}, got {value!r}")


@attrs.frozen
class TensorParallel:
    """Which shard a rank holds (``rank`` of ``world_size``) and how it talks to the other ranks.

    Build it with ``TensorParallel.of(group)`` inside an initialised process group, or directly
    (``TensorParallel(rank=0, world_size=1)``) for a one-rank model, which issues no collective and
    is exactly the single-process model.

    Attributes:
        rank: this process's rank in ``group``.
        world_size: ranks in ``group`` (1: no collectives).
        group: the ``torch.distributed`` process group (None: the default group).
        collectives: ``"inplace"`` or ``"functional"`` (``COLLECTIVE_STYLES``).
    """

    rank: int
    world_size: int
    group: Any = None
    collectives: str = attrs.field(default="inplace", validator=_style)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TensorParallel.rank must be in [0, {self.world_size}), got {self.rank}")

    @classmethod
    def of(cls, group: Any = None, collectives: str = "inplace") -> TensorParallel:
        """This process's shard in ``group`` (None: the default group) of an initialised process group.

        Raises:
            ValueError: ``torch.distributed`` is not initialised (call ``init_process_group`` first).
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(
                "TensorParallel.of needs an initialised torch.distributed process group "
                "(dist.init_process_group(...)); for one process use TensorParallel(rank=0, world_size=1)"
            )
        return cls(dist.get_rank(group), dist.get_world_size(group), group, collectives)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (the in-place style writes ``x`` and returns it)."""
        if self.world_size == 1:
            return x
        if self.collectives == "functional":
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(x, "sum", self._group())
        import torch.distributed as dist

        dist.all_reduce(x, group=self._group())
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` (``[rows, k]``) side by side along the last dimension: ``[rows, n * k]``."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.collectives == "functional":
            from torch.distributed import _functional_collectives as funcol

            # torch 2.13 renamed all_gather_tensor to all_gather_single (the old name warns); 2.11 has
            # the old name only.
            gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
            stacked = gather(x, 0, self._group())
        else:
            import torch.distributed as dist

            stacked = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
            # Likewise all_gather_into_tensor (2.11) and all_gather_single (2.13).
            gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather_into(stacked, x, group=self._group())
        # [n * rows, k] -> [rows, n * k]: rank r's block lands in columns [r * k, (r+1) * k).
        return stacked.reshape(self.world_size, -1, x.shape[-1]).movedim(0, 1).reshape(x.shape[0], -1)

    def _group(self) -> Any:
        import torch.distributed as dist

        return self.group if self.group is not None else dist.group.WORLD

    def split(self, size: int, what: str) -> int:
        """``size // world_size``, refusing a size the ranks cannot share evenly (``what`` names it)."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) must be a multiple of the tensor-parallel world size ({self.world_size})"
            )
        return size // self.world_size


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; the all-reduce of masked lookups is the full embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        rows = parallel.split(vocab_size, "DecoderConfig.vocab_size")
        self.start, self.end = parallel.rank * rows, (parallel.rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)  # other ranks' tokens read row 0...
        rows = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)  # ...and are zeroed
        return self.parallel.all_reduce(rows)


class ParallelLMHead(nn.Module):
    """This rank's vocabulary rows of the output projection; logits are all-gathered."""

    def __init__(self, hidden_size: int, vocab_size: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        self.weight = nn.Parameter(
            torch.empty(parallel.split(vocab_size, "DecoderConfig.vocab_size"), hidden_size)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_gather_last(F.linear(hidden, self.weight))


def _rows(weight: torch.Tensor, parts: list[int], parallel: TensorParallel) -> torch.Tensor:
    """The rank's slice of each consecutive block of rows (sizes ``parts``), concatenated."""
    blocks = weight.split(parts, dim=0)
    return torch.cat([b.chunk(parallel.world_size, dim=0)[parallel.rank] for b in blocks])


def shard_state_dict(
    state: Mapping[str, torch.Tensor], config: LayerSizes, parallel: TensorParallel
) -> dict[str, torch.Tensor]:
    """The tensor-parallel shard ``parallel.rank`` of a single-process ``PagedDecoder``'s weights.

    Column-parallel weights (embedding, QKV, gate/up, lm_head) keep the rank's output rows (per
    block: q, k and v heads; gate and up halves); row-parallel weights (o_proj, down) the matching
    input columns; norms are whole. Load the result into a tensor-parallel ``PagedDecoder`` built
    with the same ``parallel``.
    """
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name
        if leaf in ("embed_tokens", "lm_head"):
            w = _rows(w, [w.shape[0]], parallel)
        elif leaf == "qkv_proj":
            w = _rows(w, [q, kv, kv], parallel)
        elif leaf == "gate_up_proj":
            w = _rows(w, [inter, inter], parallel)
        elif leaf in ("o_proj", "down_proj"):
            w = _rows(w.t(), [w.shape[1]], parallel).t()
        out[name] = w.clone()
    return out
