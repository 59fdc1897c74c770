"""The devgraph SGLang platform at engine start: a bad backend setting named, graph settings that
SGLang would ignore on ``cpu`` warned about (or made to work), without an engine."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt")

from devgraph._errors import DevgraphError
from devgraph.adapters.sglang._platform import (
    CPU_PREFILL_MAX_TOKENS,
    DevgraphCpuPlatform,
    cpu_prefill_sizes,
    graph_settings_notes,
)
from devgraph.adapters.sglang._plugin import activate


@pytest.mark.parametrize("value", ["bogus", "cuda"], ids=["unknown", "unavailable"])
def test_bad_devgraph_backend_is_named_with_its_value(monkeypatch, value):
    monkeypatch.setenv("SGLANG_PLATFORM", "devgraph")
    monkeypatch.setenv("DEVGRAPH_BACKEND", value)
    with pytest.raises(DevgraphError) as refused:
        activate()
    message = str(refused.value)
    assert message.startswith(f"SGLANG_PLATFORM=devgraph with DEVGRAPH_BACKEND={value!r}: ")
    assert "Set DEVGRAPH_BACKEND to an available devgraph backend" in message


def _args(**settings):
    """SGLang's server arguments as the platform hook reads them (defaults of SGLang 0.5.23)."""
    defaults = dict(
        device="cpu",
        attention_backend=None,
        disable_cuda_graph=False,
        disable_decode_cuda_graph=False,
        enable_torch_compile=False,
        cuda_graph_bs_decode=None,
        cuda_graph_max_bs_decode=None,
        torch_compile_max_bs=32,
    )
    return SimpleNamespace(**{**defaults, **settings})


def _start(caplog, **settings):
    args = _args(**settings)
    with caplog.at_level(logging.INFO, logger="devgraph.adapters.sglang._platform"):
        DevgraphCpuPlatform().apply_server_args_defaults(args)
    return args, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_graphs_not_switched_on_are_warned_about_naming_the_option_that_works(caplog):
    _, warnings = _start(caplog)
    (warning,) = warnings
    assert "no decode graph will be captured" in warning
    assert "enable_torch_compile=True" in warning and "disable_cuda_graph=True" in warning


def test_sizes_given_without_graphs_switched_on_are_named_in_the_warning(caplog):
    _, warnings = _start(caplog, cuda_graph_bs_decode=[1, 2, 4], cuda_graph_max_bs_decode=4)
    (warning,) = warnings
    assert "though cuda_graph_bs_decode=[1, 2, 4], cuda_graph_max_bs_decode=4 was given" in warning


@pytest.mark.parametrize(
    "settings",
    [{"disable_cuda_graph": True}, {"disable_decode_cuda_graph": True}, {"enable_torch_compile": True}],
)
def test_no_warning_when_graphs_are_on_or_turned_off_on_purpose(caplog, settings):
    assert _start(caplog, **settings)[1] == []


def test_max_decode_size_is_made_to_size_the_cpu_graphs(caplog):
    args, warnings = _start(caplog, enable_torch_compile=True, cuda_graph_max_bs_decode=4)
    assert warnings == []
    assert args.torch_compile_max_bs == 4  # what SGLang sizes cpu decode graphs by


def test_max_decode_size_beside_a_size_list_is_warned_ignored(caplog):
    args, warnings = _start(
        caplog, enable_torch_compile=True, cuda_graph_max_bs_decode=8, cuda_graph_bs_decode=[1, 2]
    )
    assert warnings == [
        "devgraph SGLang platform: cuda_graph_max_bs_decode=8 is ignored on device cpu: "
        "cuda_graph_bs_decode=[1, 2] lists the decode sizes captured."
    ]
    assert args.torch_compile_max_bs == 32


def test_other_devices_get_no_cpu_notes():
    assert graph_settings_notes(_args(device="npu")) == []


def _prefill_args(**prefill):
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    config = CudaGraphConfig(prefill=PhaseConfig(**{"backend": "breakable", **prefill}))
    return _args(enable_torch_compile=True, cuda_graph_config=config)


def test_cpu_prefill_graphs_not_sized_are_bounded(caplog):
    args = _prefill_args()
    with caplog.at_level(logging.INFO, logger="devgraph.adapters.sglang._platform"):
        DevgraphCpuPlatform().apply_server_args_defaults(args)
    assert args.cuda_graph_config.prefill.max_bs == CPU_PREFILL_MAX_TOKENS == 128
    assert args.cuda_graph_config.decode.backend == "full"  # the other phase as it was
    assert any("prefill graphs up to 128 tokens on cpu" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "prefill",
    [{"max_bs": 1024}, {"bs": [8, 16]}, {"backend": "disabled"}],
    ids=["max-given", "sizes-given", "off"],
)
def test_cpu_prefill_settings_given_or_off_are_left_alone(prefill):
    args = _prefill_args(**prefill)
    before = args.cuda_graph_config
    assert cpu_prefill_sizes(args) is None and args.cuda_graph_config is before


def test_prefill_sizes_of_other_devices_are_sglangs():
    args = _prefill_args()
    args.device = "npu"
    assert cpu_prefill_sizes(args) is None and args.cuda_graph_config.prefill.max_bs is None
