"""The ``devgraph`` command: ``devgraph info [--json]``, ``devgraph demo`` and ``devgraph bisect``.

``devgraph --version`` (``-V``) prints devgraph's and torch's versions; ``-v``/``--verbose`` logs at
INFO level; ``-q``/``--quiet`` silences the capture progress bar and summary line (as
``DEVGRAPH_QUIET=1`` does). A bad option value is one line on stderr naming the option and what it
takes, exit status 2; an error of the command itself (an unavailable backend) one line, status 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import attrs

__all__ = ["main"]


def _info(args: argparse.Namespace) -> int:
    from devgraph import _plugins

    try:
        rows = _plugins.list_backends()
    except Exception as exc:  # a broken plugin: report it, do not crash with a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([attrs.asdict(r) for r in rows], indent=2))
        return 0
    header = ("backend", "status", "version", "plugin", "detail")
    table = [
        (r.name, "available" if r.available else "unavailable", r.version or "-", r.plugin, r.reason)
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header) - 1)]
    for row in [header, *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 0


def _demo(args: argparse.Namespace) -> int:
    from devgraph import DevgraphError
    from devgraph.demo import run_demo

    try:
        if args.tp is not None:
            return _tp_demo(args)
        return run_demo(device=args.device, steps=args.steps, batch_sizes=args.batch_sizes)
    except DevgraphError as exc:  # unknown/unavailable backend...: the message says what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _tp_demo(args: argparse.Namespace) -> int:
    from devgraph import DevgraphError
    from devgraph.demo import run_tp_demo

    if args.device not in (None, "cpu"):
        raise DevgraphError(
            f"demo --tp runs its ranks on the CPU reference backend (gloo), got --device {args.device}; "
            "drop --device or pass --device cpu"
        )
    return run_tp_demo(args.tp, steps=args.steps, batch_sizes=args.batch_sizes, timeout=args.timeout)


# -- option values: each type names what it takes, argparse adds the option's name ----------------


def positive_int(text: str) -> int:
    """An integer >= 1 (``--steps``, ``--batch-sizes``, ``--tp``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1, 2, ...), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1, 2, ...), got {text!r}")
    return value


def _finite(text: str, *, zero_ok: bool, takes: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise argparse.ArgumentTypeError(f"expected {takes}, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (``--timeout``)."""
    return _finite(text, zero_ok=False, takes="a number of seconds > 0 (e.g. 300)")


def tolerance(text: str) -> float:
    """A finite number >= 0 (``--atol``, ``--rtol``)."""
    return _finite(text, zero_ok=True, takes="a number >= 0 (e.g. 1e-5)")


def backend_name(text: str) -> str:
    """A registered backend's name (``--device``), available here or not (the demo says why not)."""
    from devgraph import _plugins

    names = [row.name for row in _plugins.list_backends()]
    if text not in names:
        raise argparse.ArgumentTypeError(f"expected a backend name, one of {', '.join(names)}; got {text!r}")
    return text


_MODEL_HELP = (
    "'demo' (the tiny paged decoder of `devgraph demo`, wrapped, one decode step) or MODULE:FACTORY, a "
    "function taking no arguments that returns (target, args) or (target, args, kwargs): target is "
    "what devgraph.bisect takes (a wrapped model, a callable, or a Graph then its capture function)"
)


def _add_bisect(sub: Any) -> None:
    p = sub.add_parser("bisect", help="name the first op whose graph replay differs from eager")
    p.add_argument("model", help=_MODEL_HELP)
    p.add_argument(
        "--device", type=backend_name, default=None, help="backend for 'demo' (default: best available)"
    )
    p.add_argument(
        "--batch", type=positive_int, default=1, help="'demo': rows in the decode step (default 1)"
    )
    p.add_argument(
        "--bucket",
        type=positive_int,
        default=None,
        help="'demo': the captured batch size serving it (default: --batch + 1)",
    )
    p.add_argument(
        "--atol", type=tolerance, default=0.0, help="absolute tolerance over the noise floor (>= 0)"
    )
    p.add_argument(
        "--rtol", type=tolerance, default=0.0, help="relative tolerance over the noise floor (>= 0)"
    )
    p.add_argument("--save", metavar="DIR", default=None, help="write both tensors and the report to DIR")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=_bisect)


def _factory(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    from devgraph import DevgraphError

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DevgraphError(f"model {spec!r}: give 'demo' or MODULE:FACTORY (e.g. mypkg.debug:make_case)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DevgraphError(f"model {spec!r}: cannot import {module_name!r} ({exc})") from None
    factory: Callable[[], Any] | None = getattr(module, attr, None)
    if not callable(factory):
        raise DevgraphError(f"model {spec!r}: {module_name} has no callable {attr!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise DevgraphError(
            f"model {spec!r}: {attr}() must return (target, args) or (target, args, kwargs), got "
            f"{type(made).__name__}"
        )
    target, args, kwargs = made if len(made) == 3 else (*made, {})
    return target, tuple(args), dict(kwargs)


def _bisect(args: argparse.Namespace) -> int:
    """Exit status: 0 no op differs, 1 an op differs, 2 the bisect could not run (the error says why)."""
    from devgraph import DevgraphError
    from devgraph.debug import BisectOptions, bisect

    try:
        if args.model == "demo":
            from devgraph.demo import bisect_case

            target, call_args, call_kwargs = bisect_case(args.device, args.batch, args.bucket)
        else:
            target, call_args, call_kwargs = _factory(args.model)
        options = BisectOptions(atol=args.atol, rtol=args.rtol)
        report = bisect(target, *call_args, bisect_options=options, **call_kwargs)
    except DevgraphError as exc:  # CaptureError included: the message names the op and the remedy
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the model's own error (a TypeError of its call, ...): not "an op differs"
        traceback.print_exc(file=sys.stderr)
        print(
            f"error: the bisect could not run: {type(exc).__name__}: {exc} (the traceback above says where; "
            "exit status 2, not 1, which means an op differs)",
            file=sys.stderr,
        )
        return 2
    if args.json:
        first = report.first
        print(
            json.dumps(
                {
                    "subject": report.subject,
                    "identical": report.identical,
                    "op": first.op if first else None,
                    "location": first.location if first else None,
                    "module": first.module if first else None,
                    "max_abs": first.max_abs if first else None,
                    "max_rel": first.max_rel if first else None,
                    "against": first.against if first else None,
                    "differing": report.differing,
                    "ops_compared": report.ops_compared,
                },
                indent=2,
            )
        )
    else:
        print(report.text())
    if args.save:
        for path in report.save(args.save):
            print(f"saved {path}", file=sys.stderr)
    return 0 if report.identical else 1


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``devgraph demo: error: argument --steps: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from devgraph import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"devgraph {__version__} (torch {torch}, Python {sys.version.split()[0]})"


def parser() -> argparse.ArgumentParser:
    """The ``devgraph`` command's argument parser."""
    top = _Parser(prog="devgraph", description=__doc__.split("\n\n")[0])
    top.add_argument("-V", "--version", action="version", version=_version())
    top.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    top.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no capture progress bar or summary line (DEVGRAPH_QUIET=1)",
    )
    sub = top.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="{info,demo,bisect}"
    )
    info = sub.add_parser("info", help="list backends and whether they can run here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="graph a tiny decoder, compare with eager, print a table")
    demo.add_argument(
        "--device", type=backend_name, default=None, help="backend name (default: best available)"
    )
    demo.add_argument("--steps", type=positive_int, default=16, help="decode steps to time (>= 1)")
    demo.add_argument(
        "--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 8], help="batches to run (each >= 1)"
    )
    demo.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        metavar="N",
        help="tensor parallel: spawn N CPU ranks (gloo), graph each rank's shard, compare with eager",
    )
    demo.add_argument(
        "--timeout",
        type=positive_seconds,
        default=300.0,
        help="with --tp: seconds before the ranks are killed",
    )
    demo.set_defaults(func=_demo)
    _add_bisect(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.quiet:
        os.environ["DEVGRAPH_QUIET"] = "1"
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
