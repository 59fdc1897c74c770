"""Random-number generators inside a recorded capture: replayed like a device graph, or refused.

A random op (torch tags it ``nondeterministic_seeded``) is recorded like any other and re-run at
replay on the generator it used, which draws the next numbers of that generator's stream: a replay
after ``torch.manual_seed(s)`` gives what an eager call after ``torch.manual_seed(s)`` gives, as on a
CUDA graph (whose replay reads the generator's seed and offset). Capture itself runs the work once,
so it advances the generator by one call (a CUDA capture does not).

What a graph cannot hold is a generator *re-seeded* inside the capture: ``torch.manual_seed``,
``torch.set_rng_state``, ``Generator.manual_seed`` / ``set_state``, or a ``torch.Generator()`` made
and seeded inside the block. Eager restarts the stream at every call; a replay continues it. CUDA
raises on these while capturing; here ``RngWatch`` raises ``CaptureError``:

* the default generator: its state changed between capture start, the random ops that drew from
  it, and capture end, other than by those draws;
* a generator passed explicitly (``generator=g``): its state changed after a recorded draw other
  than by a recorded draw, or it was first drawn from inside the capture in the state ``manual_seed``
  leaves it in (seeded, or made, and not drawn from since). torch hands a dispatch mode a new Python
  object for the same generator at every op, so generators are followed by their states.

What it cannot see: a re-seed that leaves the state exactly as it was (``torch.manual_seed(s)``
inside a capture begun right after ``torch.manual_seed(s)``, with no draw in between). An explicit
generator seeded before capture and first drawn from inside it is refused (it looks exactly like
one seeded inside): draw from it once before capturing (run the code once; the runner's warm-ups do).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from devgraph._errors import CaptureError
from devgraph._source import user_source_line

__all__ = ["RngWatch", "is_random"]

_REMEDY = (
    "seed before capture, not inside the captured code: call torch.manual_seed / set_rng_state (or "
    "Generator.manual_seed / set_state) outside the block and create generators outside it; a replay "
    "then draws the next numbers of the stream, as an eager call would"
)
_FRESH_REMEDY = (
    _REMEDY + ". A generator seeded before capture must be drawn from once before capturing (run the "
    "code once eagerly first; the runner's warm-ups do), or the reference backend cannot tell it from "
    "one seeded inside"
)


def is_random(func: Any) -> bool:
    """True for an aten op that draws from a random-number generator."""
    return torch.Tag.nondeterministic_seeded in func.tags


def _generator(args: Any, kwargs: Any) -> torch.Generator | None:
    """The explicit generator argument of an op, if any."""
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Generator):
            return x
    return None


def _draws_on_cpu(args: Any, kwargs: Any) -> bool:
    """True when an op without a generator argument draws from the CPU default generator."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return False
    return not any(
        isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tree_flatten((args, kwargs))[0]
    )


def _key(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()


def _fresh(gen: torch.Generator) -> bool:
    """True when ``gen`` is in the state ``manual_seed`` leaves it in (nothing drawn since)."""
    seeded = torch.Generator(device=gen.device).manual_seed(gen.initial_seed())
    return torch.equal(seeded.get_state(), gen.get_state())


class RngWatch:
    """Refuses a capture whose generators were re-seeded inside it (see the module docstring).

    Made when a capture (or a task re-issue) begins; ``before`` and ``after`` surround every recorded
    random op, ``resync`` follows work that drew while op-by-op recording was paused, ``finish`` ends
    the capture.
    """

    def __init__(self) -> None:
        self._default = torch.default_generator.get_state()
        self._explicit: dict[bytes, torch.Generator] = {}  # one per generator: keyed by a state it had
        self._left: set[bytes] = set()  # the states recorded draws left explicit generators in
        self._last: tuple[str, str | None] | None = None  # (op, source) of the last random op

    def _refuse(self, func: Any, what: str, remedy: str = _REMEDY) -> None:
        raise CaptureError(
            f"{what} inside graph capture: eager restarts the random stream at every call, a replay "
            "would continue it",
            op=func._schema.name if func is not None else "torch.manual_seed / set_rng_state",
            source=user_source_line(),
            remedy=remedy,
        )

    def _check_explicit(self, func: Any) -> None:
        for gen in self._explicit.values():
            if gen.device.type == "cpu" and _key(gen.get_state()) not in self._left:
                self._refuse(func, "a torch.Generator was re-seeded (or its state set) after drawing from it")

    def before(self, func: Any, args: Any, kwargs: Any) -> torch.Generator | None:
        """Check the generator random op ``func`` is about to draw from; return it (None: the
        default generator, or another device's)."""
        gen = _generator(args, kwargs)
        if gen is None:
            if _draws_on_cpu(args, kwargs) and not torch.equal(
                self._default, torch.default_generator.get_state()
            ):
                self._refuse(func, "the default generator was re-seeded (torch.manual_seed / set_rng_state)")
            return None
        if gen.device.type != "cpu":
            return None
        self._check_explicit(func)
        if _key(gen.get_state()) not in self._left and _fresh(gen):
            self._refuse(
                func,
                "a torch.Generator seeded (or made) and first drawn from",
                _FRESH_REMEDY,
            )
        return gen

    def after(self, func: Any, args: Any, kwargs: Any, gen: torch.Generator | None) -> None:
        """Note the state random op ``func`` left its generator in."""
        if gen is None:
            if _draws_on_cpu(args, kwargs):
                self._default = torch.default_generator.get_state()
        elif gen.device.type == "cpu":
            key = _key(gen.get_state())
            self._left.add(key)
            self._explicit = {k: g for k, g in self._explicit.items() if _key(g.get_state()) != key}
            self._explicit[key] = gen
        else:
            return
        self._last = (func._schema.name, user_source_line())

    def resync(self) -> None:
        """Accept the generators' states as they are now (after work recorded whole, a compiled
        graph say, drew from them while op-by-op recording was paused)."""
        self._default = torch.default_generator.get_state()
        for gen in self._explicit.values():
            self._left.add(_key(gen.get_state()))

    def finish(self) -> None:
        """At the end of the capture: refuse a generator re-seeded after its last draw."""
        op, source = self._last or ("torch.manual_seed / set_rng_state / Generator.manual_seed", None)
        stale = not torch.equal(self._default, torch.default_generator.get_state()) or any(
            _key(g.get_state()) not in self._left for g in self._explicit.values() if g.device.type == "cpu"
        )
        self._explicit = {}
        if stale:
            raise CaptureError(
                "a random-number generator was re-seeded (or its state set) inside graph capture, after "
                "its last draw: eager re-seeds it at every call, a replay would not",
                op=op,
                source=source,
                remedy=_REMEDY,
            )
