#!/usr/bin/env bash
# The GPU-marked tests (CUDA graphs of every stage vs eager, capture, the incremental flow's graphed
# passes), for the lent GPU machine: bench/device_run.sh and bench/device_capacity.sh call it first.
# They build random tiny weights, so they need no parity fixtures and ride along with either carry.
#   bench/device_gpu_tests.sh SECONDS OUT_FILE   (the whole log in OUT_FILE, its end printed)
timeout "$1" python3 -m pytest tests/runtime/test_flow_graphs.py tests/runtime/test_llm_cuda_graph.py \
  tests/runtime/test_llm_prefill_graph.py tests/runtime/test_flow_incremental_batch.py \
  tests/runtime/test_graph_capture.py tests/runtime/test_hift_graphs.py tests/runtime/test_compiled_graphs.py \
  tests/runtime/test_no_gpu_waits.py -m gpu -q -p no:cacheprovider --tb=short > "$2" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$2" | tail -12
