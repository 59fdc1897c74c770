"""``compare_tokens``: are two runs' tokens identical, and if not, was the first flip a near-tie?"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from devgraph._errors import DevgraphError

__all__ = ["TokenComparison", "compare_tokens", "top2_margin"]

#: margins (top-1 minus top-2 log-probability, in nats) below which a flip counts as a near-tie
NEAR_TIE = 0.05


@attrs.frozen
class TokenComparison:
    """Two runs' tokens compared (graphed vs eager).

    Attributes:
        identical: the token sequences are equal.
        position: the first position where they differ (a shorter sequence ends there), else None.
        graphed_token / eager_token: the tokens at ``position`` (None past a sequence's end).
        graphed_margin / eager_margin: at ``position``, each run's top-1 minus top-2 log-probability
            (nats; None without that run's logits).
        near_tie: both margins are below ``threshold``: either token was nearly as likely in both runs,
            so rounding alone can flip it (vLLM documents such flips). False: at least one run was
            decided, so the graphed and eager values differ by more than rounding. None: no margins.
        threshold: the near-tie threshold used (nats).
    """

    identical: bool
    position: int | None = None
    graphed_token: int | None = None
    eager_token: int | None = None
    graphed_margin: float | None = None
    eager_margin: float | None = None
    near_tie: bool | None = None
    threshold: float = NEAR_TIE

    def text(self) -> str:
        """One line: identical, or the first flip with its margins."""
        if self.identical:
            return "tokens identical"

        def m(x: float | None) -> str:
            return "?" if x is None else f"{x:.4g}"

        verdict = {True: "a near-tie", False: "not a near-tie", None: "no logits to tell"}[self.near_tie]
        return (
            f"tokens differ at position {self.position}: graphed {self.graphed_token}, eager "
            f"{self.eager_token}; top-1 minus top-2 log-prob: graphed {m(self.graphed_margin)}, eager "
            f"{m(self.eager_margin)} ({verdict}, threshold {self.threshold:g})"
        )

    __str__ = text


def top2_margin(logits: Any) -> float:
    """Top-1 minus top-2 log-probability (nats) of one position's logits (a 1-D tensor)."""
    import torch

    row = torch.as_tensor(logits).detach().reshape(-1).float()
    if row.numel() < 2:
        raise DevgraphError(f"a margin needs at least 2 logits, got {row.numel()}")
    top = torch.log_softmax(row, -1).topk(2).values
    return float(top[0] - top[1])


def _tokens(name: str, value: Any) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    try:
        tokens = [int(t) for t in value]
    except (TypeError, ValueError):
        raise DevgraphError(
            f"{name} must be a sequence of token ids (ints or a 1-D tensor), got {value!r}"
        ) from None
    return tokens


def _margin_at(name: str, logits: Any, position: int) -> float | None:
    if logits is None or position >= len(logits):
        return None
    return top2_margin(logits[position])


def compare_tokens(
    graphed: Sequence[int] | Any,
    eager: Sequence[int] | Any,
    *,
    graphed_logits: Sequence[Any] | Any = None,
    eager_logits: Sequence[Any] | Any = None,
    threshold: float = NEAR_TIE,
) -> TokenComparison:
    """Compare two runs' tokens; at the first difference, report both runs' top-1 vs top-2 margins.

    Args:
        graphed: the graphed run's token ids (ints, or a 1-D tensor).
        eager: the eager run's token ids, alike.
        graphed_logits: optional, the graphed run's logits per position (``[positions, vocab]``, or a
            list of ``[vocab]`` rows): position ``i`` is what chose token ``i``.
        eager_logits: optional, the eager run's logits, alike.
        threshold: margins (nats) below which a flip is a near-tie (default 0.05).
    Raises:
        DevgraphError: tokens that are not ids, or a negative threshold.
    """
    if not threshold >= 0:
        raise DevgraphError(f"threshold must be >= 0 (nats), got {threshold!r}")
    g, e = _tokens("graphed", graphed), _tokens("eager", eager)
    if g == e:
        return TokenComparison(True, threshold=threshold)
    position = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
    gm = _margin_at("graphed_logits", graphed_logits, position)
    em = _margin_at("eager_logits", eager_logits, position)
    margins = [m for m in (gm, em) if m is not None]
    return TokenComparison(
        identical=False,
        position=position,
        graphed_token=g[position] if position < len(g) else None,
        eager_token=e[position] if position < len(e) else None,
        graphed_margin=gm,
        eager_margin=em,
        near_tie=all(m < threshold for m in margins) if margins else None,
        threshold=threshold,
    )
