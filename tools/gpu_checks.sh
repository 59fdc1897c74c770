#!/usr/bin/env bash
# Everything devgraph verifies on a CUDA GPU, in one command, with the machine's own torch and no
# downloads: install devgraph (and its test packages: the toy plugin, devgraph_sim) in place, run the whole suite including the
# `cuda` tests, then every benchmark. Results land in benchmarks/results/ (or $OUT when set).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e tests/plugins/devgraph_toy_backend -e tests/sim || exit 1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'" || exit 1
status=0
python3 -m pytest -q -n 4 -rs tests 2>&1 | tee "$out/tests_cuda.log" || status=1
python3 benchmarks/replay_vs_eager.py --device cuda --out "$out" || status=1
python3 benchmarks/decode_step.py --device cuda --models llama --out "$out" || status=1
python3 benchmarks/decode_step.py --device cuda --models paged --merge --out "$out" || status=1
python3 benchmarks/piecewise.py --device cuda --out "$out" || status=1
python3 benchmarks/paged_attention.py --device cuda --out "$out" || status=1
python3 benchmarks/host_overhead.py --device cuda --out "$out" || status=1
exit $status
