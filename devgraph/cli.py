"""The ``devgraph`` command: ``devgraph info [--json]``, ``devgraph demo`` and ``devgraph bisect``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="devgraph", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="list backends and whether they can run here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="graph a tiny decoder, compare with eager, print a table")
    demo.add_argument("--device", default=None, help="backend name (default: best available)")
    demo.add_argument("--steps", type=int, default=16, help="decode steps to time")
    demo.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8], help="batches to run")
    demo.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallel: spawn N CPU ranks (gloo), graph each rank's shard, compare with eager",
    )
    demo.add_argument(
        "--timeout", type=float, default=300.0, help="with --tp: seconds before the ranks are killed"
    )
    demo.set_defaults(func=_demo)
    from devgraph.debug._cli import add_parser as add_bisect  # imports no torch until it runs

    add_bisect(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
