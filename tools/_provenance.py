"""Which source a result was measured on: the commit, and whether the tree held changes beyond it.

One answer for every record the project writes: each benchmark's JSON (``benchmarks/_common.py``'s
``write_json``) and the GPU one-shot's summary (``tools/_oneshot.py``) carry ``checkout(root)``::

    {"commit": "f808510...", "clean": true, "changed": [], "changed_count": 0, "from": "git", "note": ""}

Where the checkout has git, git answers (``changed``: the first lines of ``git status --porcelain``).
A lent GPU machine receives a copy of the working tree without ``.git``; there the answer comes from a
stamp written here before the run (``python3 tools/_provenance.py stamp``, which
``bash tools/gpu_oneshot.sh --stamp`` runs) and carried with the tree. The stamp names the commit, the
changes, and a digest of every file that travels; it is believed only while those files still match
it, so a stamp left over from another tree reports ``"commit": null`` and the files that differ, never
a wrong commit.

Standard library only (the one-shot's summary is written after every step, whatever the machine).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: The stamp's file name, at the root of the checkout (git-ignored: it never dirties the tree).
STAMP = ".oneshot-stamp.json"
#: How many changed paths a record lists (``changed_count`` counts them all).
LISTED = 20
ROOT = Path(__file__).resolve().parent.parent


def _git(root: Path, *args: str) -> str | None:
    """``git -C root ARGS``'s output, or None without git or outside a repository."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def from_git(root: Path) -> dict[str, Any] | None:
    """The commit and the working tree's changes as git sees them; None where git cannot tell."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    if commit is None or status is None:
        return None
    lines = status.splitlines()
    return {
        "commit": commit.strip(),
        "clean": not lines,
        "changed": lines[:LISTED],
        "changed_count": len(lines),
        "from": "git",
        "note": "",
    }


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:  # deleted since, or unreadable: a value no file's digest takes
        return "missing"


def travelling_files(root: Path) -> list[str]:
    """The files a copy of the working tree holds: tracked and untracked-but-not-ignored files that
    exist (the stamp itself left out)."""
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard") or ""
    names = {name for name in listed.split("\0") if name and name != STAMP}
    return sorted(name for name in names if (root / name).is_file())


def write_stamp(root: Path = ROOT) -> Path:
    """Write ``root/STAMP``: this checkout's ``from_git`` answer and a digest of each travelling file.

    Raises:
        SystemExit: ``root`` is not a git checkout (there is nothing to stamp from).
    """
    state = from_git(root)
    if state is None:
        raise SystemExit(f"{root} is not a git checkout (or git is missing): nothing to stamp")
    files = {name: _file_digest(root / name) for name in travelling_files(root)}
    stamp = {
        **state,
        "from": "stamp",
        "stamped": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    path = root / STAMP
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(stamp, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def from_stamp(root: Path) -> dict[str, Any] | None:
    """The stamp's answer while every file it lists still has its digest; None without a stamp."""
    path = root / STAMP
    try:
        stamp = json.loads(path.read_text())
        files: dict[str, str] = stamp["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    differ = [name for name, digest in files.items() if _file_digest(root / name) != digest]
    if differ:
        return {
            "commit": None,
            "clean": None,
            "changed": differ[:LISTED],
            "changed_count": len(differ),
            "from": "stamp (stale)",
            "note": (
                f"{STAMP} names commit {stamp.get('commit')}, stamped {stamp.get('stamped')}, but "
                f"{len(differ)} of its files differ here: this tree is not the one stamped (stamp again "
                "right before the run: bash tools/gpu_oneshot.sh --stamp)"
            ),
        }
    return {
        "commit": stamp["commit"],
        "clean": stamp["clean"],
        "changed": stamp["changed"],
        "changed_count": stamp["changed_count"],
        "from": "stamp",
        "note": f"no git here: from {STAMP}, stamped {stamp.get('stamped')}; its {len(files)} files all match",
    }


@functools.cache
def checkout(root: Path = ROOT) -> dict[str, Any]:
    """The commit this tree was measured on and whether it was clean (git, else a matching stamp).

    Read once per process and root (what a process writes later, such as results under
    ``benchmarks/results/``, does not change the answer it started with).
    """
    found = from_git(root) or from_stamp(root)
    if found is not None:
        return found
    return {
        "commit": None,
        "clean": None,
        "changed": [],
        "changed_count": 0,
        "from": "unknown",
        "note": (
            f"no git and no {STAMP} here: before a run on a copy of the tree, run "
            "`bash tools/gpu_oneshot.sh --stamp` and carry the stamp with the tree"
        ),
    }


def describe(state: dict[str, Any]) -> str:
    """One line for a log: ``commit f808510 (clean, from git)``."""
    commit = (state["commit"] or "unknown")[:12]
    if state["clean"] is None:
        how = state["from"]
    else:
        how = (
            "clean" if state["clean"] else f"{state['changed_count']} changed path(s)"
        ) + f", from {state['from']}"
    return f"commit {commit} ({how})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["stamp"]:
        root = Path(args[1]).resolve() if len(args) > 1 else ROOT
        path = write_stamp(root)
        print(f"wrote {path}: {describe(from_stamp(root) or checkout(root))}")
        return 0
    if args[:1] == ["show"]:
        root = Path(args[1]).resolve() if len(args) > 1 else ROOT
        print(json.dumps(checkout(root), indent=2))
        return 0
    print("usage: python3 tools/_provenance.py stamp [ROOT] | show [ROOT]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
