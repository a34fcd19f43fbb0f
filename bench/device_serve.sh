#!/usr/bin/env bash
# One lease of the GPU machine for the service itself. Needs .carry/site312.tar.xz (build it here
# with bench/carry_bundle.sh) and the run's `carry: [".carry"]`:
#   1. Ray Serve, pydantic, starlette, wetext from the carried bundle (the image lacks them);
#   2. GPU tests, the replica loader's included (flow graphs captured, graphed == eager);
#   3. optionally (COLOC_S > 0) the one-vs-two-deployment measurement of docs/serving.md;
#   4. a full-size random-weight CosyVoice2 directory, then the whole app from
#      configs/single-gpu.yaml under closed-loop HTTP load (bench/serve_load.py).
# Results go to $OUT (at most 8 files come back: keep it so). The whole script must end inside one
# run's 600 s: TESTS_S + COLOC_S + SERVE_S + ~60 s (bundle, model directory), e.g.
#   COLOC_S=100 SERVE_S=300 bash bench/device_serve.sh
set -u
source bench/device_site.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import ray, pydantic, starlette, wetext; print('ray', ray.__version__, 'pydantic', pydantic.__version__)" 2>&1
  python3 -m pip show aiohttp packaging grpcio protobuf msgpack 2>/dev/null | grep -E '^(Name|Version)' | paste - -
  timeout "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_flow_graphs.py tests/runtime/test_graph_capture.py \
    tests/runtime/test_hift_graphs.py tests/runtime/test_llm_cuda_graph.py tests/deployments/test_runtime_load.py 2>&1 | tail -8
} > "$OUT/checks.txt" 2>&1
cat "$OUT/checks.txt"
if [ "${COLOC_S:-0}" -gt 0 ]; then
  timeout "$COLOC_S" python3 -m bench.measure_colocation --steps 200 --flow-jobs 20 > "$OUT/colocation.txt" 2>&1
  tail -30 "$OUT/colocation.txt"
fi
python3 -m cosyvoice_runtime.tiny_model --size full --out /tmp/cv2-full > /dev/null 2>&1 || echo "full-size model: failed"
mkdir -p "$OUT/serve"
FAST_COSY_MODEL_DIR=/tmp/cv2-full timeout "${SERVE_S:-300}" python3 -m bench.serve_load --config configs/single-gpu.yaml \
  --concurrency "${CONC:-1,16,64}" --no-progress --num-cpus 16 --out "$OUT/serve/serve-h200-$(date +%F)" 2>&1 \
  | grep -v Warning | tail -40 > "$OUT/serve.log"
tail -20 "$OUT/serve.log"
