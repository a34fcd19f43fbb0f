#!/usr/bin/env bash
# The GPU-marked tests (CUDA graphs of every stage vs eager, capture, the incremental flow's graphed
# passes, no GPU waits in a streamed chunk), for the lent GPU machine: bench/device_run.sh and
# bench/device_capacity.sh call it first. They build random tiny weights, so they need no parity
# fixtures; they need the carried site.
#   bench/device_gpu_tests.sh SECONDS OUT_FILE   (the whole log in OUT_FILE, its end printed)
# The tiny model's default voice is written with soundfile, which the lent image lacks: the carried
# site (bench/carry_bundle.sh, `carry: [".carry"]`) has it (H100 2026-12-05: 4 tests failed without).
# One pytest per file, each within what is left of SECONDS: pytest prints failures at the end of a
# run, so one run cut by the limit hid which checks of three failed tests failed (H100 2026-12-05).
# The inductor-compiled graphs, the slowest to build, come last.
source bench/device_site.sh  # the carried site and the PyAV stand-in (the serve_app tests import the ingress)
end=$((SECONDS + $1))
: > "$2"
# (the deployments' GPU tests load whole tiny replicas on CUDA; TensorRT's skip: not on the lent image)
# GPU_TESTS="runtime/test_llm_cuda_graph serve_app/test_failover": these files only
for f in ${GPU_TESTS:-runtime/test_kernels runtime/test_llm_run_ahead runtime/test_llm_engine_bistream runtime/test_no_gpu_waits runtime/test_flow_incremental_batch runtime/test_flow_graphs \
         runtime/test_hift_graphs deployments/test_runtime_load runtime/test_graph_capture \
         runtime/test_llm_cuda_graph runtime/test_llm_prefill_graph deployments/test_synthesizer_heap \
         serve_app/test_failover runtime/test_compiled_graphs}; do
  left=$((end - SECONDS))
  if [ "$left" -le 5 ]; then echo "$f: not run (no time left)" | tee -a "$2"; continue; fi
  echo "== $f" >> "$2"
  timeout "$left" python3 -m pytest "tests/$f.py" -m gpu -q -p no:cacheprovider \
    --tb=short >> "$2" 2>&1
  rc=$?
  [ "$rc" = 124 ] && echo "$f: cut by the time limit" | tee -a "$2"
done
grep -E "^(==|FAILED|ERROR)|passed|failed|skipped|not run|cut by" "$2" | tail -30
