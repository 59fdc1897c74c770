"""The ``devgraph`` command: ``--version``, and a one-line error naming the option and what it takes for
every bad value of every subcommand (never a traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import devgraph
from devgraph.cli import main


def _refused(capsys, argv: list[str]) -> str:
    """The stderr of ``devgraph ARGV``, which must exit with status 2 and print one line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_version_names_devgraph_and_torch(capsys):
    for flag in ("--version", "-V"):
        with pytest.raises(SystemExit) as exit_:
            main([flag])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"devgraph {devgraph.__version__} (torch ")


def test_verbose_is_still_minus_v():
    assert main(["-v", "info", "--json"]) == 0


@pytest.mark.parametrize(
    ("argv", "option", "valid"),
    [
        (["demo", "--steps", "0"], "--steps", "positive integer"),
        (["demo", "--steps", "-3"], "--steps", "positive integer"),
        (["demo", "--steps", "many"], "--steps", "positive integer"),
        (["demo", "--batch-sizes", "4", "0"], "--batch-sizes", "positive integer"),
        (["demo", "--batch-sizes", "2.5"], "--batch-sizes", "positive integer"),
        (["demo", "--batch-sizes"], "--batch-sizes", "expected at least one argument"),
        (["demo", "--tp", "0"], "--tp", "positive integer"),
        (["demo", "--tp", "2", "--timeout", "0"], "--timeout", "seconds > 0"),
        (["demo", "--tp", "2", "--timeout", "nan"], "--timeout", "seconds > 0"),
        (["demo", "--device", "gpu"], "--device", "one of cpu, cuda, npu"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_demo_bad_value_is_one_line_naming_the_option_and_what_it_takes(capsys, argv, option, valid):
    err = _refused(capsys, argv)
    assert err.startswith("devgraph demo: error:") and option in err and valid in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["info", "--jsn"], "--jsn"),
        (["info", "extra"], "extra"),
        (["demo", "--frobnicate"], "--frobnicate"),
    ],
)
def test_unknown_option_of_a_subcommand_is_one_line_naming_it(capsys, argv, expected):
    err = _refused(capsys, argv)
    assert expected in err and "--help" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], "{info,demo,bisect}"), (["frob"], "choose from 'info', 'demo'"), (["--quite", "info"], "--quite")],
)
def test_top_level_bad_command_is_one_line_naming_the_choices(capsys, argv, expected):
    err = _refused(capsys, argv)
    assert err.startswith("devgraph: error:") and expected in err


def test_an_unavailable_backend_is_one_line_with_status_1():
    # A registered backend that cannot run here: the demo's own error, not argparse's.
    rows = {row.name: row for row in devgraph.list_backends()}
    if rows["npu"].available:
        pytest.skip("npu is available here")
    done = subprocess.run(
        [sys.executable, "-m", "devgraph", "demo", "--device", "npu", "--steps", "1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: devgraph backend 'npu' is unavailable")


@pytest.mark.parametrize(
    ("argv", "option", "valid"),
    [
        (["bisect", "demo", "--batch", "0"], "--batch", "positive integer"),
        (["bisect", "demo", "--bucket", "two"], "--bucket", "positive integer"),
        (["bisect", "demo", "--atol", "-1"], "--atol", "number >= 0"),
        (["bisect", "demo", "--rtol", "inf"], "--rtol", "number >= 0"),
        (["bisect", "demo", "--device", "gpu"], "--device", "one of cpu, cuda, npu"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bisect_bad_value_is_one_line_naming_the_option_and_what_it_takes(capsys, argv, option, valid):
    err = _refused(capsys, argv)
    assert err.startswith("devgraph bisect: error:") and option in err and valid in err


def test_the_demo_on_the_cpu_reference_prints_what_it_measures_and_no_speed_up(capsys):
    # It printed a "speed-up" column on the reference simulator right above "slower than eager".
    from devgraph.demo import run_demo

    assert run_demo("cpu", steps=1, batch_sizes=(1,)) == 0
    out = capsys.readouterr().out
    assert "speed-up" not in out
    header = next(line for line in out.splitlines() if line.startswith("batch"))
    assert "time vs eager" in header
    assert out.index("'time vs eager' is devgraph's ms/step over eager's") < out.index(header)
