"""Row-count rounding: eager on a call's own rows against eager on those rows padded to a bucket.

A device may round a row's result by how many rows the batch has: a GEMM picks its kernel by the
row count (oneDNN on AVX-512 CPUs, cuBLAS), so 3 rows alone and the same 3 rows inside a batch of 4
differ in the last bits while every row is still independent. A graph replays eager on the padded
batch bit for bit, so a padded call differs from eager on its own rows by exactly that.

The padding check (``devgraph.runner._padding``) already runs the model eagerly on ``r`` rows and on
them padded to a bucket (with the pad values, and with copies of the first row); ``measure`` reads
the row-count rounding off those runs (no extra run): the largest difference of a real row's output,
which output it is in, and how much of it moves with the padding rows' values. The runner keeps what
it found in ``stats.row_count_rounding`` and logs ``report`` once. A difference within the check's
tolerance is not a refusal: padding did not reach the real rows beyond rounding. Naming the op
is ``devgraph.bisect``'s job (it sits above the runner): its hint says the same thing op by op.

``PROMISE`` is the promise as README.md and docs/wrap.md state it, word for word (a test checks).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["PROMISE", "RowCountRounding", "measure", "report"]

#: devgraph's promise, stated exactly: the same words in README.md, docs/wrap.md and ``report``.
PROMISE = (
    "A replay equals eager on the batch it replays (the call padded to its bucket) bit for bit, so a "
    "call whose size is a bucket equals eager on its own rows bit for bit. A padded call is not "
    "bitwise eager on its own rows where the device's kernels round by row count. For bitwise "
    "equality with eager on your rows, use buckets equal to the sizes you call with."
)


@attrs.frozen
class RowCountRounding:
    """Eager on ``rows`` rows against eager on the same rows padded to ``bucket``, as the padding
    check found it at capture on the device in hand.

    ``max_abs``: the largest difference of a real row's value (over both fills the check pads with);
    ``output``: the output leaf it is in (``tree_flatten`` order); ``from_pad_values``: the largest
    difference between the two fills (the pad values, copies of the first row) on the real rows:
    0.0 where only the row count rounds, above it where the padding rows' values reach the real
    rows (below the check's tolerance) or a kernel is nondeterministic.
    """

    rows: int
    bucket: int
    max_abs: float
    output: int
    from_pad_values: float = 0.0


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|`` (NaN on both sides and equal infinities count as equal), computed in
    the tensors' own dtype: no float64 copy of a large output (logits) at capture."""
    if a.numel() == 0 or not (a.is_floating_point() or a.is_complex()) or torch.equal(a, b):
        return 0.0  # integers and booleans were compared exactly by the padding check
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return float((a - b).abs().masked_fill_(same, 0).max())


def measure(
    exact: Sequence[object],
    fills: tuple[Sequence[object], Sequence[object]],
    dims: Sequence[int | None],
    rows: int,
    bucket: int,
) -> RowCountRounding | None:
    """The row-count rounding of one probe of the padding check (None: bitwise equal).

    ``exact``: the output leaves for the ``rows`` real rows; ``fills``: the leaves for them padded to
    ``bucket`` with the pad values and with copies of the first row; ``dims``: per leaf, the dim cut
    to the real rows (None: compared whole). Called once the check found the outputs close.
    """
    worst, where, between = 0.0, 0, 0.0
    for i, (c, d) in enumerate(zip(exact, dims)):
        if not isinstance(c, torch.Tensor):
            continue
        a, b = fills[0][i], fills[1][i]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue  # the padding check refused such an output already
        real = [t.narrow(d, 0, rows) if d is not None else t for t in (a, b)]
        found = max(_max_abs(t, c) for t in real)
        if found > worst:
            worst, where = found, i
        between = max(between, _max_abs(real[0], real[1]))
    if worst == 0.0:
        return None
    return RowCountRounding(rows, bucket, worst, where, between)


def report(found: Sequence[RowCountRounding], device: str, option: str) -> str:
    """The one line a runner logs about ``found`` (on ``device``; ``option`` sets its buckets)."""
    sizes = "; ".join(
        f"{f.rows} row{'s' if f.rows > 1 else ''} padded to {f.bucket}: up to {f.max_abs:.2g} "
        f"(output leaf {f.output})"
        for f in found
    )
    mixed = [f.from_pad_values for f in found if f.from_pad_values > 0]
    if mixed:
        cause = (
            f"the real rows also change with the padding rows' values (by up to {max(mixed):.2g} between "
            "the pad values and copies of the first row, below the padding check's tolerance): rows mix "
            "slightly, or a kernel is nondeterministic"
        )
    else:
        cause = "the real rows depend on the padding rows' count, not on their values"
    return (
        f"devgraph: row-count rounding on {device}, eager on a call's own rows against eager on them "
        f"padded to its bucket: {sizes}; {cause}. {PROMISE[:-1]} ({option}=[...]). "
        "graphed.stats.row_count_rounding holds this; devgraph.bisect(graphed, x) names the op"
    )
