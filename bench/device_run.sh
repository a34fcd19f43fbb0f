#!/usr/bin/env bash
# One lease of the GPU machine: streaming benchmark first (it matters most), then the LLM
# decode micro-benchmark and the CUDA-graph GPU tests if time remains. Results go to $OUT.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout "${BENCH_S:-420}" python3 -m bench.gpu_bench --family cosyvoice2 \
  --modes "${MODES:-pytorch-bf16-graphs,pytorch-bf16,pytorch-fp32}" --concurrency "${CONC:-1,4,8,16,32,64}" \
  --tokens 250 --baseline-requests 3 --min-requests 6 --out "$OUT/results" 2>&1 | grep -v Warning | tee "$OUT/bench.log" | tail -30
timeout 60 python3 -m pytest tests/runtime/test_llm_cuda_graph.py -m gpu -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
timeout 90 python3 -m bench.llm_decode_bench --out "$OUT/llm_decode.json" > "$OUT/llm_decode.log" 2>&1; tail -15 "$OUT/llm_decode.log"
