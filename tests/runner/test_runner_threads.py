"""One graphed model, several threads: a call's output is never another thread's.

Outputs are views of graph memory overwritten by the next replay. Without ``clone_outputs`` one
live thread at a time may call a runner (a second is refused with an error naming
``clone_outputs=True``); with it, any number of threads may, each getting its own copy.
"""

from __future__ import annotations

import threading

import pytest
import torch

import devgraph
from devgraph import DevgraphError

JOIN_SECONDS = 120  # every test here finishes in seconds; a hang fails instead of blocking the suite


class Tanh(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _x(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


def _run_threads(targets) -> None:
    threads = [threading.Thread(target=t, name=f"worker-{i}") for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_SECONDS)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"


def _wrap(mode: str, **options):
    model = Tanh()
    if mode == "full":
        graphed = devgraph.wrap(model, device="cpu", batch_sizes=[1, 2, 4], **options)
    else:
        graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2, 4], **options)
    graphed.capture(_x(1, 0))
    return graphed, model


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_second_threads_call_never_overwrites_the_first_threads_output(mode):
    graphed, model = _wrap(mode)
    first_called, second_done = threading.Event(), threading.Event()
    kept = {}

    def first():
        x = _x(2, 1)
        kept["out"], kept["want"] = graphed(x), model(x).detach()
        first_called.set()
        second_done.wait(JOIN_SECONDS)  # alive and still holding its output while the other calls
        kept["after"] = kept["out"].clone()

    def second():
        first_called.wait(JOIN_SECONDS)
        try:
            graphed(_x(2, 2))  # the same bucket: a replay would overwrite the first output
        except DevgraphError:
            pass
        finally:
            second_done.set()

    _run_threads([first, second])
    torch.testing.assert_close(kept["after"], kept["want"])


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_second_live_thread_is_refused_naming_clone_outputs(mode):
    graphed, _ = _wrap(mode)
    graphed(_x(2, 1))  # this (main) thread uses the wrapper and stays alive
    errors = []

    def other():
        try:
            graphed(_x(2, 2))
        except DevgraphError as exc:
            errors.append(str(exc))

    _run_threads([other])
    assert len(errors) == 1 and "clone_outputs=True" in errors[0]


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_four_threads_with_clone_outputs_each_get_their_own_results(mode):
    graphed, model = _wrap(mode, clone_outputs=True)
    calls, wrong, failures = 150, [], []
    start = threading.Barrier(4)

    def worker(seed):
        def run():
            try:
                start.wait(JOIN_SECONDS)
                for i in range(calls):
                    x = _x(1 + (seed + i) % 4, seed * 1000 + i)
                    if not torch.allclose(graphed(x).clone(), model(x), atol=1e-6):
                        wrong.append((seed, i))
            except Exception as exc:  # collected: pytest does not see thread exceptions
                failures.append(exc)

        return run

    with torch.no_grad():
        _run_threads([worker(s) for s in range(4)])
    assert not failures and not wrong
    # through Dynamo (the default front end of both modes) capture() is a real call of the model: one
    # replay more
    assert graphed.stats.replays == 4 * calls + 1


def test_four_threads_with_defaults_one_is_served_and_three_are_refused():
    graphed, model = _wrap("full")
    start, finish = threading.Barrier(4), threading.Barrier(4)
    served, refused, wrong = [], [], []

    def worker(seed):
        def run():
            start.wait(JOIN_SECONDS)
            try:
                for i in range(50):
                    x = _x(2, seed * 100 + i)
                    if not torch.allclose(graphed(x).clone(), model(x), atol=1e-6):
                        wrong.append((seed, i))
                served.append(seed)
            except DevgraphError as exc:
                refused.append(str(exc))
            finish.wait(JOIN_SECONDS)  # every thread stays alive until all are done

        return run

    with torch.no_grad():
        _run_threads([worker(s) for s in range(4)])
    assert not wrong
    assert len(served) == 1 and len(refused) == 3
    assert all("clone_outputs=True" in message for message in refused)


def test_a_thread_may_call_once_the_thread_before_it_has_ended():
    graphed, model = _wrap("full")
    results = []

    def call(seed):
        def run():
            x = _x(3, seed)
            results.append(torch.allclose(graphed(x), model(x), atol=1e-6))

        return run

    with torch.no_grad():
        for seed in range(3):  # one after another, as a server that starts a thread per request
            _run_threads([call(seed)])
    assert results == [True, True, True]


def test_capture_on_one_thread_then_serving_on_another_is_allowed():
    graphed, model = _wrap("full")  # captured on the main thread (capture returns no outputs)
    results = []

    def serve():
        x = _x(4, 7)
        results.append(torch.allclose(graphed(x), model(x), atol=1e-6))

    with torch.no_grad():
        _run_threads([serve])
    assert results == [True]


def test_hf_generate_from_two_live_threads_gives_each_its_own_tokens():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=16)
    prompts = {
        seed: torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)
    }
    want = {s: model.generate(p, do_sample=False, max_new_tokens=4) for s, p in prompts.items()}
    got, failures = {}, []
    start = threading.Barrier(2)

    def worker(seed):
        def run():
            try:
                start.wait(JOIN_SECONDS)
                for _ in range(3):
                    got.setdefault(seed, []).append(graphed.generate(prompts[seed], max_new_tokens=4))
            except Exception as exc:  # generate() serialises whole generations: no thread is refused
                failures.append(exc)

        return run

    _run_threads([worker(1), worker(2)])
    assert not failures
    assert all(torch.equal(out, want[s]) for s, outs in got.items() for out in outs)
    assert graphed.stats.fallbacks == {}
