"""What ``tools/gpu_oneshot.sh`` needs from Python: the summary JSON, the environment record, and
the ``.dist-info`` folders of its offline install fallback.

Every summary records the commit and whether the tree was clean (``"checkout"``, from
``tools/_provenance.py``: git, or on a lent machine's copy of the tree the stamp carried with it).

Standard library only, and never imports torch except in ``env`` (the summary is rewritten after
every step, so it must cost milliseconds and work whatever state the machine is in)::

    python3 tools/_oneshot.py init SUMMARY --mode first --device cuda --deadline 540 --steps env:30,install:120
    python3 tools/_oneshot.py step SUMMARY NAME --status ok --rc 0 --seconds 3.2 [--tests JSONL] [--note TEXT]
    python3 tools/_oneshot.py finish SUMMARY
    python3 tools/_oneshot.py env OUT_JSON
    python3 tools/_oneshot.py dist-info FOLDER ROOT
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _provenance import checkout, describe

#: What a step's status means (docs/development.md repeats this table).
STATUSES = {
    "pending": "not started yet (the run was cut short before it, or is still going)",
    "running": "started; the run ended while it was running (killed from outside)",
    "ok": "exited 0",
    "failed": "exited non-zero: read its log",
    "timeout": "killed at its time limit (SIGABRT first: Python stacks are in its log), then SIGKILL",
    "skipped": "not started: too little time was left before the global deadline",
}

#: The distributions whose versions the environment record names.
PACKAGES_RECORDED = (
    "torch", "transformers", "triton", "pytest", "pytest-xdist", "hypothesis", "numpy", "matplotlib",
    "setuptools", "pip", "vllm", "sglang", "devgraph",
)  # fmt: skip
GPU_FIELDS = "name,driver_version,memory.total,compute_cap,clocks.max.sm"

#: The distributions the install step would install from this checkout (name, pyproject folder).
PACKAGES = (
    ("devgraph", "."),
    ("devgraph-sim", "tests/sim"),
    ("devgraph-toy-backend", "tests/plugins/devgraph_toy_backend"),
)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _write(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` whole (a kill mid-write leaves the previous version)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# -- the summary -------------------------------------------------------------------------------------


def init(args: argparse.Namespace) -> None:
    steps = []
    for spec in args.steps.split(","):
        name, cap = spec.split(":")
        steps.append({"name": name, "status": "pending", "limit_s": int(cap)})
    _write(
        args.summary,
        {
            "script": "tools/gpu_oneshot.sh",
            "command": args.command,
            "mode": args.mode,
            "dry_run": args.dry_run,
            "device": args.device,
            "deadline_s": args.deadline,
            "started": _now(),
            "started_epoch": time.time(),
            "updated": _now(),
            "elapsed_s": 0.0,
            "finished": False,
            "install": None,
            "checkout": checkout(Path(__file__).resolve().parent.parent),
            "statuses": STATUSES,
            "steps": steps,
        },
    )


def _test_counts(jsonl: Path) -> dict[str, Any] | None:
    """Outcome counts from the per-test lines ``tools/oneshot_pytest.py`` appends (a killed run too)."""
    if not jsonl.exists():
        return None
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failed: list[str] = []
    for line in jsonl.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed run may be cut
            continue
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        if row["outcome"] in ("failed", "error"):
            failed.append(row["nodeid"])
    counts["not_passed"] = failed[:50]
    return counts


def step(args: argparse.Namespace) -> None:
    summary = _read(args.summary)
    (row,) = [s for s in summary["steps"] if s["name"] == args.name]
    row["status"] = args.status
    for key in ("rc", "seconds", "limit_s", "log", "note"):
        value = getattr(args, key)
        if value is not None:
            row[key] = value
    if args.outputs:
        row["outputs"] = args.outputs
    if args.tests is not None:
        counts = _test_counts(args.tests)
        if counts is not None:
            row["tests"] = counts
    if args.install is not None:
        summary["install"] = args.install
    summary["updated"] = _now()
    summary["elapsed_s"] = round(time.time() - summary["started_epoch"], 1)
    _write(args.summary, summary)


def finish(args: argparse.Namespace) -> None:
    summary = _read(args.summary)
    summary["finished"] = True
    summary["updated"] = _now()
    summary["elapsed_s"] = round(time.time() - summary["started_epoch"], 1)
    counts: dict[str, int] = {}
    for row in summary["steps"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    summary["counts"] = counts
    _write(args.summary, summary)
    width = max(len(s["name"]) for s in summary["steps"])
    for row in summary["steps"]:
        seconds = f"{row['seconds']:7.1f} s" if "seconds" in row else " " * 9
        tests = row.get("tests")
        extra = (
            f"  tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
            + (f", {tests['error']} errors" if tests.get("error") else "")
            if tests
            else ""
        )
        note = f"  ({row['note']})" if row.get("note") else ""
        print(f"{row['name']:<{width}}  {row['status']:<8}{seconds}{extra}{note}")
    print(
        f"total {summary['elapsed_s']:.1f} s of a {summary['deadline_s']} s deadline; summary: {args.summary}"
    )
    print(
        f"measured on {describe(summary['checkout'])}"
        + (f": {summary['checkout']['note']}" if summary["checkout"]["note"] else "")
    )


# -- the environment record --------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return (done.stdout + done.stderr).strip()


def env(args: argparse.Namespace) -> None:
    """GPU, driver, Python and package versions: what every number of the run must be read with."""
    record: dict[str, Any] = {
        "timestamp": _now(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "packages": {name: _version(name) for name in PACKAGES_RECORDED},
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "NVIDIA_", "DEVGRAPH_", "TORCH_"))
        },
        "nvidia_smi": _run(["nvidia-smi", f"--query-gpu={GPU_FIELDS}", "--format=csv"]),
        "nvidia_smi_full": _run(["nvidia-smi"]),
    }
    try:
        import torch

        record["torch"] = {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "cuda_available": torch.cuda.is_available(),
            "devices": [
                {
                    "name": torch.cuda.get_device_name(i),
                    "capability": list(torch.cuda.get_device_capability(i)),
                    "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
                }
                for i in range(torch.cuda.device_count())
            ]
            if torch.cuda.is_available()
            else [],
            "has_accelerator_graph": hasattr(torch.accelerator, "Graph"),
        }
    except Exception as exc:  # recorded: the environment is what it is
        record["torch"] = {"error": f"{type(exc).__name__}: {exc}"}
    _write(args.out, record)
    print(json.dumps({k: record[k] for k in ("python", "packages", "nvidia_smi", "torch")}, indent=2))


# -- the offline install fallback ----------------------------------------------------------------------


def dist_info(args: argparse.Namespace) -> None:
    """A ``<name>-<version>.dist-info`` (METADATA, entry_points.txt) per package of this checkout,
    read from its pyproject.toml, in ``args.folder``: with that folder and the packages' source folders
    on ``PYTHONPATH``, ``importlib.metadata`` finds their entry points (the toy backend's ``devgraph``
    entry point, devgraph's own) as it would after ``pip install -e``."""
    import tomllib

    args.folder.mkdir(parents=True, exist_ok=True)
    for name, where in PACKAGES:
        project = tomllib.loads((args.root / where / "pyproject.toml").read_text())["project"]
        assert project["name"] == name, (project["name"], name)
        info = args.folder / f"{name.replace('-', '_')}-{project['version']}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {project['version']}\n"
            f"Summary: {project.get('description', '')} (source checkout on PYTHONPATH, not installed)\n"
        )
        lines = []
        for group, points in project.get("entry-points", {}).items():
            lines.append(f"[{group}]")
            lines += [f"{key} = {value}" for key, value in points.items()]
            lines.append("")
        (info / "entry_points.txt").write_text("\n".join(lines))
        print(f"{info.name}: {sum(len(p) for p in project.get('entry-points', {}).values())} entry points")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command_name", required=True)
    p = sub.add_parser("init")
    p.add_argument("summary", type=Path)
    p.add_argument("--mode", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--deadline", type=int, required=True)
    p.add_argument("--steps", required=True, help="name:limit_s,...")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--command", default="")
    p.set_defaults(fn=init)
    p = sub.add_parser("step")
    p.add_argument("summary", type=Path)
    p.add_argument("name")
    p.add_argument("--status", required=True, choices=sorted(STATUSES))
    p.add_argument("--rc", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--limit-s", type=int)
    p.add_argument("--log")
    p.add_argument("--note")
    p.add_argument("--outputs", nargs="*")
    p.add_argument("--tests", type=Path, help="the step's per-test JSON lines (tools/oneshot_pytest.py)")
    p.add_argument("--install", help="how devgraph was made importable (pip, pythonpath)")
    p.set_defaults(fn=step)
    p = sub.add_parser("finish")
    p.add_argument("summary", type=Path)
    p.set_defaults(fn=finish)
    p = sub.add_parser("env")
    p.add_argument("out", type=Path)
    p.set_defaults(fn=env)
    p = sub.add_parser("dist-info")
    p.add_argument("folder", type=Path)
    p.add_argument("root", type=Path)
    p.set_defaults(fn=dist_info)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
