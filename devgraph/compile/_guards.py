"""Refuse a piecewise trace that only holds for some token counts (a branch on the token count).

The piecewise runner traces the forward once with the token dimension symbolic and then calls the
compiled pieces directly at every size, bypassing Dynamo's guards. A forward that branches on the
token count (``if x.shape[0] == 1:``) leaves a *shape guard* in Dynamo's ``ShapeEnv``: the trace
holds only where the guard does. ``check_token_guards`` evaluates every guard on the token symbols
at a spread of token counts and raises ``DevgraphError`` naming the user's line when one fails at a
captured size; one that fails only above the largest captured size bounds the trace (``TraceBound``).

Dynamo assumes a dynamic size is at least 2 and decides ``x.shape[0] == 1`` statically, without a
guard; ``symbolic_sizes`` turns that assumption off for the trace (``backed_size_oblivious``), so
the comparison is recorded as a guard like any other.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from devgraph._errors import DevgraphError

__all__ = ["TraceBound", "check_token_guards", "sample_sizes", "symbolic_sizes"]

#: torch's ``SLoc.maybe_user_loc``: ``"<code>  # <short file>:<line> in <function>"``.
_USER_LOC = re.compile(r"^(?P<code>.*)  # (?P<file>.+):(?P<line>\d+) in (?P<func>\S+)$")


def _torch_dir(*parts: str) -> str:
    import torch

    return os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), *parts)


_DYNAMO = _torch_dir("_dynamo") + os.sep
_INDUCTOR = _torch_dir("_inductor") + os.sep
_DYNAMO_OP_PROPAGATION = _torch_dir("_dynamo", "utils.py")  # run_node / get_fake_value


@contextlib.contextmanager
def symbolic_sizes() -> Iterator[None]:
    """Trace with sizes 0 and 1 possible, so branches on them become guards (see module docstring)."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]  # install_config_module
        yield


def sample_sizes(run_sizes: Sequence[int] | None) -> list[int]:
    """Token counts a guard is checked at: ``run_sizes`` (None: every count from 1) and, above
    the largest of them, every count up to twice it (at least 64 more), then powers of two and
    their neighbours up to 2**20: calls above the captured sizes run the pieces at their own size."""
    largest = max(run_sizes) if run_sizes else 0
    sizes = set(run_sizes) if run_sizes else set()
    sizes.update(range(largest + 1, 2 * largest + 65))
    p = 128
    while p <= 2**20:
        sizes.update(n for n in (p - 1, p, p + 1) if n > largest)
        p *= 2
    return sorted(sizes)


def check_token_guards(
    shape_env: Any, symbols: Iterable[Any], run_sizes: Sequence[int] | None
) -> TraceBound | None:
    """Check every guard on the token symbols at the token counts the pieces run at.

    A guard failing at a captured size (or, with ``run_sizes`` None, at the smallest counts) is a
    refusal. A guard that holds at every captured size and fails only above the largest -- a branch
    such as ``if x.shape[0] <= 4096``, or inductor's ``2816*tokens <= 2**31 - 1`` (32-bit indexing)
    -- bounds the trace instead: the pieces serve counts up to the bound, and the runner serves
    larger calls eagerly (fallback ``size_beyond_trace``).

    Args:
        shape_env: the trace's ``ShapeEnv``.
        symbols: the token dimensions' symbols (all of them take the same value at run time).
        run_sizes: the captured token counts (a call is padded up to one of them; counts above the
            largest run uncaptured at their own size); None: the pieces run at every count.
    Returns:
        The tightest bound, or None when every guard holds at every sampled count.
    Raises:
        DevgraphError: naming the user's line that branched, the guard and a size where it fails.
    """
    tokens = set(symbols)
    if not tokens:
        return None
    sizes = sample_sizes(run_sizes)
    floor = max(run_sizes) if run_sizes else 1  # the counts that must hold: every captured one
    bound: TraceBound | None = None
    for guard in shape_env.guards:
        expr = shape_env.replace(guard.expr)
        free = expr.free_symbols
        if not free or not free <= tokens:
            continue  # not about the token count (or about symbols the runner does not set)
        if not _bakes_a_decision(guard.sloc):
            continue
        failing = [n for n in sizes if _fails(expr, tokens, n)]
        if not failing:
            continue
        first = failing[0]
        if first <= floor:
            raise DevgraphError(
                f"the forward branches on the token count ({_user_line(guard.sloc)}); the piecewise trace "
                f"holds only where {_readable(expr, tokens)}, not for {_some(failing)} tokens, and the "
                "compiled pieces run at every captured size without re-checking. "
                "Make the forward the same code for every token count (torch.where instead of Python "
                f"branching on x.shape), {_size_remedy(failing, run_sizes)}or use mode='full' (one capture "
                "per batch size)"
            )
        last_good = max(n for n in sizes if n < first)  # every sampled count up to it holds
        limit = _first_failure(expr, tokens, last_good, first) - 1
        if bound is None or limit < bound.tokens:
            bound = TraceBound(limit, _readable(expr, tokens), _user_line(guard.sloc))
    return bound


@attrs.frozen
class TraceBound:
    """The largest token count a piecewise trace holds for, and the guard that sets it.

    Attributes:
        tokens: calls of more tokens than this must not run the traced pieces.
        condition: the guard, over ``tokens`` (``2816*tokens <= 2147483647``).
        where: the line that made it (the user's branch, or inductor's code generation).
    """

    tokens: int
    condition: str
    where: str

    def describe(self) -> str:
        return f"the piecewise trace holds only where {self.condition} ({self.where})"


def _first_failure(expr: Any, tokens: set[Any], good: int, bad: int) -> int:
    """The smallest count in ``(good, bad]`` where the guard fails (bisection: ``good`` holds,
    ``bad`` fails; between two samples a guard is taken to change once)."""
    while bad - good > 1:
        mid = (good + bad) // 2
        if _fails(expr, tokens, mid):
            bad = mid
        else:
            good = mid
    return bad


def _some(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:5])) + (
        f" (and {len(sizes) - 5} more sampled)" if len(sizes) > 5 else ""
    )


def _size_remedy(failing: list[int], run_sizes: Sequence[int] | None) -> str:
    """Dropping captured sizes helps when the trace fails at captured sizes only (calls are padded up)."""
    if not run_sizes or max(failing) >= max(run_sizes):
        return ""
    return f"capture_sizes without {_some(failing)} (smaller calls are padded up to the next captured size), "


def _bakes_a_decision(sloc: Any) -> bool:
    """Whether a guard records a decision the compiled pieces keep: Dynamo evaluating the user's
    Python (a branch, a comparison) or inductor generating code for a size.

    Guards from propagating fake tensors through an op (Dynamo's ``run_node``, meta functions) do
    not: eager pieces run the same aten ops, which decide again at run time.
    """
    loc = sloc.framework_loc
    path = getattr(loc, "filename", None)
    if not isinstance(path, str):
        return False
    path = os.path.abspath(path)
    if path.startswith(_INDUCTOR):
        return True
    return path.startswith(_DYNAMO) and path != _DYNAMO_OP_PROPAGATION


def _fails(expr: Any, tokens: set[Any], n: int) -> bool:
    try:
        return not bool(expr.xreplace({s: n for s in tokens}))
    except TypeError:  # not decidable from the sizes alone
        return False


def _readable(expr: Any, tokens: set[Any]) -> str:
    import sympy

    name = sympy.Symbol("tokens", integer=True, positive=True)
    return str(expr.xreplace({s: name for s in tokens}))


def _user_line(sloc: Any) -> str:
    """``"path:LINE: code"`` of the guard's user frame (torch shortens the path; find the real one)."""
    where = getattr(sloc, "maybe_user_loc", None)
    if not where:
        return f"an unknown line ({sloc})"
    match = _USER_LOC.match(where)
    if not match:
        return where
    short, line, code = match["file"], match["line"], match["code"].strip()
    return f"{_full_path(short) or short}:{line}: {code}"


def _full_path(short: str) -> str | None:
    """The loaded module file that torch's shortened ``short`` names (None when ambiguous or absent)."""
    found = {
        os.path.abspath(path)
        for module in list(sys.modules.values())
        if isinstance(path := getattr(module, "__file__", None), str) and path.endswith(short)
    }
    return found.pop() if len(found) == 1 else None
