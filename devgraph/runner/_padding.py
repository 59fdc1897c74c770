"""Whether a call padded up to a bucket gives its real rows what eager gives them.

A runner pads a batch of 3 to the captured bucket 4 and cuts the outputs back to 3 rows. That is
exact only when rows are independent (no batch norm in training mode, no reduction over the batch,
no branch on the batch size, no attention across padded tokens) and every output is either cut
along one batch dim or the same whatever the padding. ``check_padding`` finds out at capture, with
three eager runs of the model on the example call's rows: exactly ``r`` rows, ``r`` rows padded to
the bucket with the pad values, and padded with copies of the first row. Outputs whose real rows
differ, or that cannot be cut (a flattened ``[B*H]`` output, one list entry per row, a Python value
that depends on the batch size), make the runner serve only calls whose size is a bucket exactly.

The model's state is compared as its outputs are: each run starts from the state before capture
(``StateSnapshot``: tensors, random-number generators), and what a padded run writes must equal
what the exact run writes wherever the exact run writes (``self.n += x.shape[0]`` counts the
padding rows; a running minimum takes the pad value). Elements only a padded run writes (a KV
cache's scratch slot that padding rows point at) are allowed when the real rows, run once more on
top of that state, give what they give on top of the exact run's.

Outputs within the tolerance but not bit for bit equal are the device's row-count rounding (a
kernel chosen by the row count rounds otherwise), not a refusal: the verdict carries it
(``devgraph.runner._rounding``) and the runner reports it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten, tree_map

from devgraph.runner._calls import Call
from devgraph.runner._config import RunnerConfig
from devgraph.runner._rounding import RowCountRounding, measure
from devgraph.runner._snapshot import StateSnapshot

__all__ = ["PaddingVerdict", "check_padding"]

#: what a runner answers for padded calls that cannot be served exactly (the fallback category).
CATEGORY = "padding_changes_result"


@attrs.frozen
class PaddingVerdict:
    """``out_dims``: per output leaf, the dim cut to the real rows (None: returned whole);
    ``exact_only``: why padded calls must run eagerly (None: padding is safe); ``rounding``: the
    row-count rounding the check's runs show (``devgraph.runner._rounding``)."""

    out_dims: list[int | None] | None
    exact_only: str | None
    #: eager on the real rows against eager on them padded, where not bit for bit (padding safe only)
    rounding: tuple[RowCountRounding, ...] = ()


def _clone(out: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        low = a.dtype in (torch.float16, torch.bfloat16)
        return torch.allclose(a, b, rtol=2e-2 if low else 1e-3, atol=1e-3 if low else 1e-5, equal_nan=True)
    return torch.equal(a, b)


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


class _Runs:
    """The padding check's eager runs of ``r`` real rows (the example call's, repeated when it has
    fewer), exactly and padded to ``size``, each from the model's ``state`` before capture."""

    def __init__(
        self,
        run: Callable[[dict[str, torch.Tensor], dict[str, list[Any]]], Any],
        example: Call,
        size: int,
        r: int,
        config: RunnerConfig,
        state: StateSnapshot | None,
    ) -> None:
        self.run, self.size, self.r, self.config, self.state = run, size, r, config, state
        pick = torch.arange(r) % example.batch
        self.real = {
            n: x.index_select(config.batch_dim(n), pick.to(x.device)) for n, x in example.batched.items()
        }
        self.host = {n: [v[i] for i in pick.tolist()] for n, v in example.host.items()}

    def padded(self, copy_first: bool) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
        """The real rows padded to ``size`` with the pad values, or with copies of the first row."""
        tensors = {}
        for n, x in self.real.items():
            d = self.config.batch_dim(n)
            shape = list(x.shape)
            shape[d] = self.size - self.r
            if copy_first:
                fill = x.narrow(d, 0, 1).expand(shape)
            else:
                fill = torch.full(shape, self.config.pad_value(n), dtype=x.dtype, device=x.device)
            tensors[n] = torch.cat([x, fill], d)
        extra = self.size - self.r
        lists = {
            n: v + ([v[0]] if copy_first else [self.config.pad_value(n)]) * extra
            for n, v in self.host.items()
        }
        return tensors, lists

    def exact_rows(self) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
        # Each run gets its own copies: a model may write its inputs.
        return {n: x.clone() for n, x in self.real.items()}, {n: list(v) for n, v in self.host.items()}

    def fresh(self, inputs: tuple[dict[str, torch.Tensor], dict[str, list[Any]]]) -> tuple[Any, Written]:
        """One run from the state before capture: its outputs and the tensors it wrote."""
        if self.state is not None:
            self.state.restore()
        out = _clone(self.run(*inputs))
        return out, self.state.tensor_values() if self.state is not None else {}

    def then_exact(self, first: tuple[dict[str, torch.Tensor], dict[str, list[Any]]]) -> Any:
        """The real rows' outputs when they run right after ``first`` (from the state before capture)."""
        self.fresh(first)
        if self.state is not None:
            self.state.restore_rng()
        return _clone(self.run(*self.exact_rows()))


def check_padding(
    run: Callable[[dict[str, torch.Tensor], dict[str, list[Any]]], Any],
    example: Call,
    size: int,
    r: int,
    config: RunnerConfig,
    state: StateSnapshot | None = None,
) -> PaddingVerdict:
    """Compare the model's outputs for ``r`` real rows (the example call's, repeated when it has
    fewer) with those rows padded to ``size`` (``run(batched, host)`` runs the model eagerly), and
    what each run writes into the model's ``state`` (each run starts from it). Where padding is
    safe, the verdict carries the row-count rounding those runs show (``_rounding.measure``).

    Raises whatever the model raises on such rows.
    """
    runs = _Runs(run, example, size, r, config, state)
    exact, wrote = runs.fresh(runs.exact_rows())
    with_pad, wrote_pad = runs.fresh(runs.padded(False))
    with_copies, wrote_copies = runs.fresh(runs.padded(True))
    flat_c, spec_c = tree_flatten(exact)
    flat_a, spec_a = tree_flatten(with_pad)
    flat_b, spec_b = tree_flatten(with_copies)
    if spec_a != spec_c or spec_b != spec_c:
        return PaddingVerdict(
            None,
            f"the output's structure depends on the batch size ({len(flat_c)} leaves for {r} rows, "
            f"{len(flat_a)} for {size}): an output with one entry per row cannot be cut to the real rows. "
            "Return batched tensors ([batch, ...])",
        )
    dims = _cut_dims(flat_a, flat_b, flat_c, size, r)
    if isinstance(dims, PaddingVerdict):
        return dims
    if state is not None:
        for fill, written, copy_first in (
            ("the pad values", wrote_pad, False),
            ("copies of the first row", wrote_copies, True),
        ):
            verdict = _state_verdict(wrote, written, f"{r} rows padded to {size} with {fill}", r)
            if verdict is not None:
                return verdict
            extra = _written_beyond(wrote, written)
            if extra and not _all_close(
                runs.then_exact(runs.padded(copy_first)), runs.then_exact(runs.exact_rows())
            ):
                return PaddingVerdict(
                    None,
                    f"the padding rows write {', '.join(extra[:4])} where the real rows do not ({r} rows padded "
                    f"to {size} with {fill}), and the real rows' outputs of the next call differ after it: "
                    "padded rows must write only where no real row reads (a scratch slot of the cache)",
                )
    found = measure(flat_c, (flat_a, flat_b), dims, r, size)
    return PaddingVerdict(dims, None, () if found is None else (found,))


def _cut_dims(
    flat_a: list[Any], flat_b: list[Any], flat_c: list[Any], size: int, r: int
) -> list[int | None] | PaddingVerdict:
    """Per output leaf, the dim cut to the real rows (None: returned whole), or the refusal: a leaf
    that cannot be cut, or whose real rows differ beyond rounding when padded (``flat_a``: padded
    with the pad values, ``flat_b``: with copies of the first row, ``flat_c``: the ``r`` rows alone)."""
    rows = f"{r} rows padded to {size}"
    dims: list[int | None] = []
    for i, (a, b, c) in enumerate(zip(flat_a, flat_b, flat_c)):
        what = f"output leaf {i}"
        if not (isinstance(a, torch.Tensor) and isinstance(c, torch.Tensor)):
            if not (_same(a, c) and _same(b, c)):
                return PaddingVerdict(
                    None,
                    f"{what} is {c!r} for {r} rows but {a!r} for {rows}: a value that depends on the batch "
                    "size cannot be cut to the real rows. Compute it outside the model",
                )
            dims.append(None)
            continue
        if a.shape == c.shape:
            d = None
            real_a, real_b = a, b
        else:
            differ = [k for k in range(a.dim()) if a.dim() == c.dim() and a.shape[k] != c.shape[k]]
            if (
                a.dim() != c.dim()
                or len(differ) != 1
                or a.shape[differ[0]] != size
                or c.shape[differ[0]] != r
            ):
                return PaddingVerdict(
                    None,
                    f"{what} has shape {list(c.shape)} for {r} rows and {list(a.shape)} for {rows}: it is not "
                    "cut along one batch dim (a flattened [batch*n] output?). Return [batch, ...] outputs",
                )
            d = differ[0]
            real_a, real_b = a.narrow(d, 0, r), b.narrow(d, 0, r)
        if not (_close(real_a, c) and _close(real_b, c)):
            kind = "real rows" if d is not None else "value (it has no batch dim)"
            return PaddingVerdict(
                None,
                f"{what}'s {kind} change when {rows}: the model mixes rows (batch norm in training mode, a "
                "reduction over the batch, a branch on the batch size, attention across padded tokens). "
                "Rows must be independent for padding; call model.eval() or make rows independent",
            )
        dims.append(d)
    return dims


#: Per tensor of the model's state a run wrote: (its values after the run, the mask of elements it changed).
Written = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _all_close(a: Any, b: Any) -> bool:
    flat_a, spec_a = tree_flatten(a)
    flat_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(
        _close(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else _same(x, y)
        for x, y in zip(flat_a, flat_b)
    )


def _state_verdict(exact: Written, padded: Written, rows: str, r: int) -> PaddingVerdict | None:
    """Refuse padding when a padded run leaves the model's state other than the exact run does
    wherever the exact run wrote it."""
    for path, (values, mask) in exact.items():
        other = padded.get(path)
        if other is None or not _close(other[0][mask], values[mask]):
            return PaddingVerdict(
                None,
                f"the model's state {path!r} after {r} rows differs when {rows}: the forward's update of it "
                "sees the padding rows (a count of x.shape[0], a running statistic over the batch). Count "
                "and reduce over real rows only (pass the row count as a tensor), or call with batch sizes "
                "that are buckets",
            )
    return None


def _written_beyond(exact: Written, padded: Written) -> list[str]:
    """The state tensors a padded run wrote where the exact run did not."""
    found = []
    for path, (_, mask) in padded.items():
        other = exact.get(path)
        if other is None or bool((mask & ~other[1]).any()):
            found.append(repr(path))
    return found
