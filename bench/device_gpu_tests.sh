#!/usr/bin/env bash
# The GPU-marked tests (CUDA graphs of every stage vs eager, capture, the incremental flow's graphed
# passes), for the lent GPU machine: bench/device_run.sh and bench/device_capacity.sh call it first.
# They build random tiny weights, so they need no parity fixtures; they need the carried site.
#   bench/device_gpu_tests.sh SECONDS OUT_FILE   (the whole log in OUT_FILE, its end printed)
# The tiny model's default voice is written with soundfile, which the lent image lacks: the carried
# site (bench/carry_bundle.sh, `carry: [".carry"]`) has it (H100 2026-12-05: 4 tests failed without).
if [ -f .carry/site312.tar.xz ] && [ ! -d /tmp/site ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .carry/site312.tar.xz
fi
PYTHONPATH=/tmp/site:$PWD timeout "$1" python3 -m pytest tests/runtime/test_flow_graphs.py tests/runtime/test_llm_cuda_graph.py \
  tests/runtime/test_llm_prefill_graph.py tests/runtime/test_flow_incremental_batch.py \
  tests/runtime/test_graph_capture.py tests/runtime/test_hift_graphs.py tests/runtime/test_compiled_graphs.py \
  tests/runtime/test_no_gpu_waits.py -m gpu -q -p no:cacheprovider --tb=short > "$2" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$2" | tail -12
