#!/usr/bin/env bash
# One lease of the GPU machine: GPU tests (quick), the streaming benchmark (it matters most),
# then the execution variants (estimator, vocoder, encoder) if time remains. Results go to $OUT.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout "${TESTS_S:-90}" python3 -m pytest tests/runtime/test_flow_graphs.py tests/runtime/test_llm_cuda_graph.py tests/runtime/test_graph_capture.py tests/runtime/test_hift_graphs.py -m gpu -q \
  -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
timeout "${BENCH_S:-420}" python3 -m bench.gpu_bench --deadline-s "${DEADLINE_S:-90}" --family "${FAMILY:-cosyvoice2}" \
  --modes "${MODES:-pytorch-bf16-allgraphs-early,pytorch-bf16-allgraphs-early-edf,pytorch-bf16-graphs-early}" \
  --concurrency "${CONC:-1,4,8,16,32,64}" --tokens 250 --baseline-requests 3 --min-requests 6 \
  --out "$OUT/results" ${TAG:+--tag "$TAG"} 2>&1 | grep -v Warning | tee "$OUT/bench.log" | tail -30
if [ "${VARIANTS_S:-0}" -gt 0 ]; then
  timeout "$VARIANTS_S" python3 -m bench.profile_stages --variants-only --out "$OUT/variants" 2>&1 \
    | grep -v Warning | tail -8
fi
