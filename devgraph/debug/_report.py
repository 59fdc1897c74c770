"""What a bisect found: the first op whose replayed output differs from eager, and how it measured."""

from __future__ import annotations

import os
import re
from typing import Any

import attrs

__all__ = ["BisectReport", "OpDifference"]


#: ``"path:LINE: code"`` or ``"path:LINE"`` (``devgraph._source.render``); the path may hold colons
_LOCATION = re.compile(r"^(.*):(\d+)(?:: .*)?$", re.S)


def _num(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.3g}"


@attrs.frozen
class OpDifference:
    """One op whose replayed output differs from eager beyond the noise floor.

    Attributes:
        index: the op's position in the graph run (0 = the first op the captured code issued).
        op: the aten (or custom) op, ``namespace::name``.
        source: ``"file.py:LINE: code"`` of the user's line that issued it (None: not found).
        module: the ``nn.Module`` path that issued it (``"layers.0.mlp"``; None for a plain callable).
        max_abs: the largest ``|graph - eager|`` (``inf``: NaN or inf on one side only).
        max_rel: ``max_abs`` relative to the largest ``|eager|`` of that output.
        noise_floor: the difference two eager runs of this op showed (what ``max_abs`` must exceed,
            besides ``atol + rtol * |eager|``).
        against: which eager run: ``"the call"`` (the inputs as given) or ``"the padded batch"``
            (eager on the bucket's padded inputs: padding rows compared too).
        where: the index of the largest difference in the graph's output tensor.
        graph_value / eager_value: the two outputs (graph's as replayed, uncut), for inspection.
        hint: what the kind of difference usually means (empty when nothing specific).
        inside: for an op inside ``torch.compile``'d code (recorded whole by the graph run), which
            compiled graph and how the bisect found the op in it (empty for an op of the graph run).
    """

    index: int
    op: str
    source: str | None
    module: str | None
    max_abs: float
    max_rel: float
    noise_floor: float
    against: str
    where: tuple[int, ...]
    graph_value: Any = attrs.field(eq=False, repr=False)
    eager_value: Any = attrs.field(eq=False, repr=False)
    hint: str = ""
    inside: str = ""

    @property
    def location(self) -> str:
        """``file.py:LINE`` of the user's line (``"<unknown line>"`` when none was found)."""
        if self.source is None:
            return "<unknown line>"
        found = _LOCATION.match(self.source)
        return f"{found.group(1)}:{found.group(2)}" if found else self.source

    def summary(self) -> str:
        """One line: the op, where, and by how much."""
        where = f" in {self.module}" if self.module else ""
        return (
            f"{self.op} at {self.location}{where}: max |graph - eager| {_num(self.max_abs)} "
            f"(relative {_num(self.max_rel)})"
        )


@attrs.frozen
class BisectReport:
    """The result of ``devgraph.bisect``: ``first`` is the first op that differs (None: none does).

    ``str(report)`` (``text()``) is the readable report: the op, its ``file:line``, module path,
    differences, the noise floor and how it was measured. ``save(folder)`` writes the two tensors of
    the first difference for inspection (``torch.load``).

    Attributes:
        subject: what was bisected (the model, and which graph: the bucket serving the call...).
        device: the device the graph was captured on.
        ops_compared: how many ops both runs issued and were compared.
        first: the first differing op (None: every compared op agreed).
        differing: how many compared ops differed.
        largest: the op with the largest relative difference (None: none differed).
        noise: how the noise floor was measured.
        tolerance: ``(atol, rtol)`` added to the measured noise floor.
        output_max_abs: the largest difference of the final outputs (graph replay vs eager on the
            call; padding rows cut).
        unmatched: ops only one run issued (``"graph: aten::x"`` / ``"eager: aten::y"``): code that
            branches differently, or a splitting op run eagerly between pieces.
        reproduces: for a wrapped model, whether the bisect's own capture gave the served graph's
            output (None: not a wrapped model). False means the served graph differs from a fresh
            capture of the same bucket (it was captured before weights or inputs changed).
        notes: what else the bisect noticed (host arguments frozen at capture...).
    """

    subject: str
    device: str
    ops_compared: int
    first: OpDifference | None
    differing: int
    largest: OpDifference | None
    noise: str
    tolerance: tuple[float, float]
    output_max_abs: float
    unmatched: tuple[str, ...] = ()
    reproduces: bool | None = None
    notes: tuple[str, ...] = ()

    @property
    def identical(self) -> bool:
        """True when no compared op differed beyond the noise floor."""
        return self.first is None

    def text(self) -> str:
        """The readable report (also ``str(report)``)."""
        lines = [f"devgraph bisect: {self.subject} on {self.device}"]
        first = self.first
        if first is None:
            lines.append(f"no op differs beyond the noise floor ({self.ops_compared} ops compared)")
        else:
            lines += [
                f"first difference: op {first.index} of the graph run, {first.op}",
                f"  at     {first.source or '<unknown line>'}",
                f"  module {first.module or '-'}",
                *([f"  inside {first.inside}"] if first.inside else []),
                f"  max |graph - eager| = {_num(first.max_abs)} (relative {_num(first.max_rel)}) at "
                f"{list(first.where)}, against eager on {first.against}",
                f"  noise floor {_num(first.noise_floor)}, atol {_num(self.tolerance[0])}, "
                f"rtol {_num(self.tolerance[1])}",
                *([f"  hint   {first.hint}"] if first.hint else []),
                "  tensors: report.first.graph_value, report.first.eager_value (report.save(folder))",
                f"ops compared: {self.ops_compared}, differing: {self.differing}",
            ]
            if self.largest is not None and self.largest is not first:
                lines.append(f"largest relative difference: {self.largest.summary()}")
        lines.append(f"noise floor: {self.noise}")
        lines.append(f"output: max |graph - eager| = {_num(self.output_max_abs)}")
        if self.reproduces is not None:
            lines.append(
                "the served graph's output equals this capture's"
                if self.reproduces
                else "the served graph's output differs from this capture's (captured before a change?)"
            )
        if self.unmatched:
            shown = ", ".join(self.unmatched[:6]) + (" ..." if len(self.unmatched) > 6 else "")
            lines.append(f"ops one run issued and the other did not ({len(self.unmatched)}): {shown}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = text

    def save(self, folder: str | os.PathLike[str]) -> list[str]:
        """Write the first difference's tensors to ``folder`` (``graph.pt``, ``eager.pt``) and the
        text to ``report.txt``; returns the paths. Nothing but the text when no op differs."""
        import torch

        os.makedirs(folder, exist_ok=True)
        paths = []
        if self.first is not None:
            for name, value in (("graph", self.first.graph_value), ("eager", self.first.eager_value)):
                path = os.path.join(folder, f"{name}.pt")
                torch.save(value, path)
                paths.append(path)
        path = os.path.join(folder, "report.txt")
        with open(path, "w") as f:
            f.write(self.text() + "\n")
        paths.append(path)
        return paths
