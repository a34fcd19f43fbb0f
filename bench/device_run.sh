#!/usr/bin/env bash
# One lease of the GPU machine: GPU tests (quick), the CosyVoice2 streaming benchmark (it matters
# most), optionally CosyVoice3 (CV3_S > 0), its vocoder strategies (VOC_S > 0) and the execution
# variants (VARIANTS_S > 0), and the flow pass check of both families (STEPPER_S > 0, seconds per family:
# bench/stepper_check.py --incremental). Everything is written under /tmp/work and packed into $OUT/results.tgz
# after every step (a run returns at most 8 files; a step cut short keeps what the earlier ones
# wrote). The whole script must end inside one run's 600 s: TESTS_S + BENCH_S + CV3_S + VOC_S +
# VARIANTS_S + ~60 s (the full-size random-weight model directory, written once per machine).
#   BENCH_S=380 CV3_S=110 bash bench/device_run.sh        # the benchmarks
#   TESTS_S=1 BENCH_S=0 VARIANTS_S=500 bash bench/device_run.sh   # the execution variants only
#   TESTS_S=150 BENCH_S=0 STEPPER_S=150 bash bench/device_run.sh   # GPU tests, then the pass timings
#   BENCH_ARGS="--debug cosyvoice_runtime" adds flags to bench/gpu_bench.py (here: a line per captured graph)
# The benchmark measures the product's synthesizer replica, arms as overrides of
# configs/single-gpu.yaml's synthesizer (bench/replica.py):
#   ARMS="default torchscript:mode=torchscript"   (space-separated NAME[:KEY=VALUE,...]; CV3_ARMS for CosyVoice3)
# It imports the serving stack (Ray Serve, pydantic), which the lent image lacks: it needs the
# run's `carry: [".carry"]` with .carry/site312.tar.xz (bench/carry_bundle.sh).
set -u
export PYTHONPATH=$PWD
W=/tmp/work
mkdir -p "$W"
pack() { tar -czf "$OUT/results.tgz" -C "$W" .; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$W/gpu.txt"
bash bench/device_gpu_tests.sh "${TESTS_S:-90}" "$W/gpu_tests.txt"
pack
if [ "${STEPPER_S:-0}" -gt 0 ]; then  # pass times: stepped recompute vs whole solve, incremental vs recomputed pass
  for f in cosyvoice2 cosyvoice3; do
    timeout "$STEPPER_S" python3 -m bench.stepper_check --family "$f" --incremental --out "$W/stepper-check-$f.json" \
      2>&1 | tail -c 1500
  done
  pack
fi
bench() {  # family, seconds, out folder, arms (space-separated), concurrencies
  if [ ! -f .carry/site312.tar.xz ]; then echo "gpu_bench: no .carry/site312.tar.xz (carry .carry)"; return; fi
  source bench/device_site.sh
  # the full-size random-weight model, shared with bench/device_capacity.sh on a warm machine
  [ -d "/tmp/$1-full" ] || python3 -m cosyvoice_runtime.tiny_model --size full --family "$1" --out "/tmp/$1-full" \
    > /dev/null 2>&1 || echo "full-size $1 model: failed"
  arms=()
  for a in $4; do arms+=(--arm "$a"); done
  RAY_USAGE_STATS_ENABLED=0 timeout "$2" python3 -m bench.gpu_bench \
    --deadline-s "${DEADLINE_S:-90}" --family "$1" --model-dir "/tmp/$1-full" ${arms[@]+"${arms[@]}"} \
    --concurrency "$5" --tokens 250 --baseline-requests 3 --min-requests 6 --out "$W/$3" ${TAG:+--tag "$TAG"} ${BENCH_ARGS:-} 2>&1 \
    | grep -v Warning > "$W/$3.log"
  tail -12 "$W/$3.log"
  pack
}
if [ "${BENCH_S:-420}" -gt 0 ]; then
  bench cosyvoice2 "${BENCH_S:-420}" results "${ARMS:-default torchscript:mode=torchscript}" "${CONC:-1,4,8,16,32,64}"
fi
if [ "${CV3_S:-0}" -gt 0 ]; then
  bench cosyvoice3 "$CV3_S" results-cv3 "${CV3_ARMS:-default vrecompute:token2wav.cv3_vocoder=recompute}" \
    "${CV3_CONC:-1,16,64}"
fi
if [ "${VOC_S:-0}" -gt 0 ]; then  # CosyVoice3 vocoder: full recompute vs incremental, per call
  timeout "$VOC_S" python3 -m bench.cv3_vocoder --seconds 10 --batch 1,8,16 --out "$W/cv3-vocoder" 2>&1 \
    | grep -v Warning | tail -8
  pack
fi
if [ "${VARIANTS_S:-0}" -gt 0 ]; then
  timeout "$VARIANTS_S" python3 -m bench.profile_stages --variants-only --out "$W/variants" 2>&1 \
    | grep -v Warning | tail -8
  pack
fi
cp "$W/gpu_tests.txt" "$OUT/"
