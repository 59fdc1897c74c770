"""Sessions: tests (default), lint, typecheck, demo, tests-cuda (GPU machines only).

Test environments pin torch through constraints.txt to the CPU wheel CI installs (2.13.0);
the package itself supports torch 2.11+.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

CONSTRAINTS = ("-c", "constraints.txt")


def _install(session: nox.Session, extras: str) -> None:
    session.install(*CONSTRAINTS, "torch==2.13.0")
    session.install(*CONSTRAINTS, "-e", f".[{extras}]")
    # The third-party backend used by the plugin tests, installed so its entry point is discovered.
    session.install("--no-deps", "-e", "tests/plugins/devgraph_toy_backend")


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite on the CPU reference backend and the torch_npu simulator."""
    _install(session, "test,hf,progress")
    workers = os.environ.get("DEVGRAPH_TEST_WORKERS", "2")
    session.run("pytest", "-n", workers, "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests and benchmarks."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "devgraph", "tests", "benchmarks", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over devgraph/."""
    session.install(*CONSTRAINTS, "torch==2.13.0")
    session.install(*CONSTRAINTS, "-e", ".[hf,progress]", "mypy>=1.10")
    session.run("mypy", "devgraph")


@nox.session
def demo(session: nox.Session) -> None:
    """devgraph's main job: graph the tiny reference decoder and compare with eager."""
    _install(session, "progress")
    session.install("numpy")  # torch warns at import without it
    session.run("devgraph", "demo", *session.posargs)


@nox.session(name="tests-cuda", venv_backend="none")
def tests_cuda(session: nox.Session) -> None:
    """On a CUDA machine: the suite with the `cuda` tests, then the benchmarks (tools/gpu_checks.sh).

    Uses the machine's own torch and installs nothing from the network (GPU hosts may have none).
    """
    session.run("bash", "tools/gpu_checks.sh", *session.posargs, external=True)
