"""The engines' sampled check: on every n-th replayed step, run the step eagerly too and compare.

Switched on with ``DEVGRAPH_COMPARE_EAGER=n`` (off when unset or 0: the adapters then do nothing
more than test one module attribute per replay). On a sampled step the adapter hands the replayed
output and a way to run the same step eagerly; the check compares the outputs and, where the output
is (or yields) logits, each row's greedy token with its top-1 vs top-2 margins (``compare_tokens``),
and logs what differs. ``results`` keeps the recent comparisons.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from devgraph._errors import DevgraphError
from devgraph.debug._tokens import NEAR_TIE, TokenComparison, compare_tokens

__all__ = ["BISECT_ENV", "ENV", "EagerCheck", "StepComparison", "eager_check_from_env"]

logger = logging.getLogger("devgraph.debug")

ENV = "DEVGRAPH_COMPARE_EAGER"
#: when a sampled step is bisected: ``flip`` (default: a row's greedy token flipped and it was not a
#: near-tie), ``difference`` (any difference from eager), ``never``
BISECT_ENV = "DEVGRAPH_COMPARE_EAGER_BISECT"
BISECT_ON = ("flip", "difference", "never")


@attrs.frozen
class StepComparison:
    """One sampled step: the largest output difference and the rows whose greedy token flipped."""

    engine: str
    step: int
    max_abs: float
    rows: int
    flips: tuple[tuple[int, TokenComparison], ...] = ()
    #: the bisect of the step, run when a flip was not a near-tie and the adapter can bisect (else None)
    bisect: Any = attrs.field(default=None, eq=False)

    def text(self) -> str:
        head = f"devgraph {self.engine} step {self.step}: graphed vs eager max |diff| {self.max_abs:.3g}"
        if not self.flips:
            return head + f", greedy tokens identical on {self.rows} rows"
        lines = [head + f", {len(self.flips)} of {self.rows} rows flip their greedy token:"]
        lines += [f"  row {row}: {c.text()}" for row, c in self.flips]
        if self.bisect is not None:
            lines.append(str(self.bisect))
        return "\n".join(lines)

    __str__ = text


def _every(environ: Mapping[str, str]) -> int:
    raw = environ.get(ENV, "").strip()
    if raw in ("", "0", "off", "false", "no"):
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 1:
        raise DevgraphError(
            f"{ENV}={raw!r}: give a positive integer n (every n-th replayed step also runs eagerly and is "
            "compared), or 0 / unset to switch it off"
        )
    return n


def eager_check_from_env(engine: str, environ: Mapping[str, str] | None = None) -> EagerCheck | None:
    """The check ``DEVGRAPH_COMPARE_EAGER`` asks for (None when it is off).

    Raises:
        DevgraphError: a value that is not a non-negative integer.
    """
    environ = os.environ if environ is None else environ
    every = _every(environ)
    bisect_on = environ.get(BISECT_ENV, "").strip() or "flip"
    if bisect_on not in BISECT_ON:
        raise DevgraphError(
            f"{BISECT_ENV}={bisect_on!r}: give flip (bisect a step where a greedy token flipped and it was "
            "not a near-tie), difference (any step that differs from eager) or never"
        )
    return EagerCheck(engine, every, bisect_on=bisect_on) if every else None


def _tensor_leaves(value: Any) -> list[Any]:
    import torch

    from devgraph.graph import tree_tensors

    if hasattr(value, "__dataclass_fields__") and not isinstance(value, torch.Tensor):
        value = [getattr(value, f) for f in value.__dataclass_fields__]
    return tree_tensors(value)


class EagerCheck:
    """Compare every ``every``-th replayed step of ``engine`` with the same step run eagerly."""

    def __init__(
        self, engine: str, every: int, *, threshold: float = NEAR_TIE, keep: int = 64, bisect_on: str = "flip"
    ) -> None:
        if bisect_on not in BISECT_ON:
            raise DevgraphError(f"bisect_on must be one of {BISECT_ON}, got {bisect_on!r}")
        self.bisect_on = bisect_on
        self.engine = engine
        self.every = every
        self.threshold = threshold
        self.replays = 0
        self.results: collections.deque[StepComparison] = collections.deque(maxlen=keep)

    def due(self) -> bool:
        """Count a replay; True when this one is sampled."""
        self.replays += 1
        return self.replays % self.every == 0

    def compare(
        self,
        graphed: Any,
        run_eager: Callable[[], Any],
        logits_of: Callable[[Any], Any] | None = None,
        bisect: Callable[[], Any] | None = None,
        *,
        real_rows: int | None,
    ) -> StepComparison:
        """Run the step eagerly (``run_eager``, with ``torch.compile``'d code run as its original code)
        and compare it with the replayed output ``graphed``.

        ``logits_of(output)`` gives the step's ``[rows, vocab]`` logits (None: the output has none);
        without it, an output that is a 2-D floating tensor is taken as the logits. ``bisect()``
        bisects the step (``devgraph.bisect`` on it): run when a row's flip is not a near-tie, or as
        the check's ``bisect_on`` says (``"difference"``: any difference; ``"never"``).
        ``real_rows`` (required, so that every caller decides): the step's real rows (tokens) when it
        was padded to a captured size; padding rows hold whatever the kernels left there (an engine's
        eager attention may not write them: vLLM's FULL steps), so only the first ``real_rows`` rows of
        each output are compared. None compares every row: for a step that is not padded (devgraph's
        SGLang decode graphs replay exact sizes).
        """
        import torch

        from devgraph.debug._compare import diff_tensors
        from devgraph.debug._compiled import truly_eager

        def cut(t: Any) -> Any:
            if real_rows is None or not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] < real_rows:
                return t
            return t[:real_rows]

        graphed_leaves = [cut(t.detach().clone()) for t in _tensor_leaves(graphed)]
        with torch.no_grad(), truly_eager():  # compiled code runs as its original code
            eager = run_eager()
        eager_leaves = [cut(t) for t in _tensor_leaves(eager)]
        max_abs = 0.0
        for a, b in zip(graphed_leaves, eager_leaves):
            d = diff_tensors(a, b)
            if d.comparable:
                max_abs = max(max_abs, d.max_abs)
        g_logits, e_logits = cut(self._logits(graphed, logits_of)), cut(self._logits(eager, logits_of))
        flips: list[tuple[int, TokenComparison]] = []
        rows = 0
        if g_logits is not None and e_logits is not None and g_logits.shape == e_logits.shape:
            rows = g_logits.shape[0]
            g_tok, e_tok = g_logits.argmax(-1), e_logits.argmax(-1)
            for row in torch.nonzero(g_tok != e_tok).flatten().tolist():
                c = compare_tokens(
                    [g_tok[row]],
                    [e_tok[row]],
                    graphed_logits=g_logits[row : row + 1],
                    eager_logits=e_logits[row : row + 1],
                    threshold=self.threshold,
                )
                flips.append((row, c))
        report = None
        due = {
            "flip": any(c.near_tie is False for _, c in flips),
            "difference": max_abs > 0,
            "never": False,
        }[self.bisect_on]
        if bisect is not None and due:
            try:
                report = bisect()
            except Exception as exc:  # a debug aid must not break the step: say why there is no bisect
                logger.warning("devgraph: the bisect of step %d failed: %s", self.replays, exc)
        result = StepComparison(self.engine, self.replays, max_abs, rows, tuple(flips), report)
        self.results.append(result)
        (logger.warning if flips else logger.info)("%s", result.text())
        return result

    @staticmethod
    def _logits(output: Any, logits_of: Callable[[Any], Any] | None) -> Any:
        import torch

        if logits_of is not None:
            try:
                value = logits_of(output)
            except Exception as exc:  # a debug aid must not break the step: say why margins are missing
                logger.info("devgraph: no logits for the eager comparison (%s)", exc)
                return None
        else:
            value = output
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point():
            return value.detach().float()
        return None
