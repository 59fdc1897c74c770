"""Refuse a piecewise trace that only holds for some token counts (a branch on the token count).

The piecewise runner traces the forward once with the token dimension symbolic and then calls the
compiled pieces directly at every size, bypassing Dynamo's guards. A forward that branches on the
token count (``if x.shape[0] == 1:``) leaves a *shape guard* in Dynamo's ``ShapeEnv``: the trace
holds only where the guard does. ``check_token_guards`` evaluates every guard on the token symbols
at a spread of token counts and raises ``DevgraphError`` naming the user's line when one fails at a
captured size; above the largest, a call runs only where ``guards_hold`` (checked per call).

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

from devgraph._errors import DevgraphError

__all__ = ["check_token_guards", "guards_hold", "sample_sizes", "symbolic_sizes", "token_guards"]

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


def check_token_guards(shape_env: Any, symbols: Iterable[Any], run_sizes: Sequence[int] | None) -> None:
    """Raise ``DevgraphError`` when a guard on the token symbols fails at a captured token count (with
    ``run_sizes`` None: at any count). Counts above the largest captured one are checked per call.

    Args:
        shape_env: the trace's ``ShapeEnv``.
        symbols: the token dimensions' symbols (all of them take the same value at run time).
        run_sizes: the captured token counts (a call is padded up to one of them; counts above the
            largest run uncaptured at their own size); None: the pieces run at every count.
    Raises:
        DevgraphError: naming the user's line that branched, the guard and a size where it fails.
    """
    tokens = set(symbols)
    if not tokens:
        return
    sizes = sample_sizes(run_sizes)
    for guard in shape_env.guards:
        expr = shape_env.replace(guard.expr)
        free = expr.free_symbols
        if not free or not free <= tokens:
            continue  # not about the token count (or about symbols the runner does not set)
        if not _bakes_a_decision(guard.sloc):
            continue
        failing = [n for n in sizes if _fails(expr, tokens, n)]
        if run_sizes:
            # Above the largest captured count a call runs uncaptured, and the runner checks there
            # that a trace holds at its count (``guards_hold``), else runs it eagerly: such a guard
            # (a branch like ``if x.shape[0] <= 4096``, inductor's 32-bit indexing,
            # ``2816*tokens <= 2147483647``, met on an H100) bounds what the trace serves.
            failing = [n for n in failing if n <= max(run_sizes)]
        if failing:
            raise DevgraphError(
                f"the forward branches on the token count ({_user_line(guard.sloc)}); the piecewise trace "
                f"holds only where {_readable(expr, tokens)}, not for {_some(failing)} tokens, and the "
                "compiled pieces replay at every captured size without re-checking. "
                "Make the forward the same code for every token count (torch.where instead of Python "
                f"branching on x.shape), {_size_remedy(failing, run_sizes)}or use mode='full' (one capture "
                "per batch size)"
            )


def token_guards(shape_env: Any, symbols: Iterable[Any]) -> tuple[tuple[Any, str], ...]:
    """``(sympy expression, user line)`` of each guard on the token symbols alone that records a
    decision the compiled pieces keep: the trace holds where every one does (``guards_hold``)."""
    tokens = set(symbols)
    found = []
    for guard in shape_env.guards if tokens else ():
        expr = shape_env.replace(guard.expr)
        free = expr.free_symbols
        if free and free <= tokens and _bakes_a_decision(guard.sloc):
            found.append((expr, _user_line(guard.sloc)))
    return tuple(found)


def guards_hold(guards: Iterable[tuple[Any, str]], symbols: Iterable[Any], n: int) -> bool:
    """Whether every guard of ``token_guards`` holds with the token symbols at ``n``."""
    tokens = set(symbols)
    return not any(_fails(expr, tokens, n) for expr, _ in guards)


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
