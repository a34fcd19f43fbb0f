#!/usr/bin/env bash
# One lease call of the capacity tool (bench/capacity.py) on the GPU machine. Needs
# .carry/site312.tar.xz (bench/carry_bundle.sh) and the run's `carry: [".carry"]`: the serve level
# needs Ray Serve from it, both levels pydantic. Results are packed into $OUT/capacity.tgz after
# every step (a run returns at most 8 files). The whole call must end inside 600 s:
# SYNTH_S + SERVE_S + ~40 s.
#   SERVE_S=520 bash bench/device_capacity.sh
#   SYNTH_S=250 SERVE_S=300 ...: the config's deployments in-process first, then over Serve
#   SYNTH_CONFIGS="configs/single-gpu.yaml /tmp/b.yaml" SYNTH_S=170: one in-process run per config (A/B);
#   SYNTH_CONFIGS="configs/single-gpu.yaml@120 /tmp/b.yaml@200" gives each arm its own limit
#   ARMS="default recompute:token2wav.cv2_flow=recompute" SYNTH_S=500: arms in one in-process run,
#   each the config's synthesizer with overrides (bench/replica.py; space-separated NAME[:KEY=VALUE,...]),
#   one after the other within SYNTH_S. (The replica simulation of REPLICA_S / MODES is gone: an
#   arm runs the product's replica.)
#   CAP_ARGS="--no-open-loop --start 2" adds flags to every bench/capacity.py call;
#   CAP_ARGS="--no-sessions --rate-start 4" searches the Poisson rate alone (slo_rate_rps*)
#   CAP_ARGS="--loads 52 --no-open-loop" probes fixed loads, no search (A/B arms with SYNTH_CONFIGS)
#   SERVE_ARMS="cold:;nocold:--cold-voice-share 0" SERVE_S=200: serve-level arms in one call (SERVE_S each)
#   COLD_S=240 measures a new replica's cold start COLD_RUNS times (default 2; bench/cold_start.py; COLD_S each),
#   then waits up to COLD_GRAPHS_S (default COLD_S / 2) for the graphs captured in the background;
#   COLD_ARMS="first all" measures each synthesizer.graphs_before_ready value in turn (COLD_S each)
#   FAMILY=cosyvoice3 measures CosyVoice3 at both levels (default cosyvoice2)
#   TESTS_S=200 runs the GPU-marked tests first (bench/device_gpu_tests.sh; no parity fixtures needed;
#   on the H200 2026-12-05, 70 s ran 11 of the 19)
#   PROFILE_S=150 profiles single requests of the in-process level first (bench/profile_first_audio.py:
#   what the GPU does before first audio, per CUDA stream; the last request's Chrome trace);
#   PROFILE_SESSIONS=N then profiles N sessions of steady load (default none: at 56 the profiler's
#   own overhead broke the load, p99 6.6 s, H100 2026-12-05; a few sessions stay readable);
#   PROFILE_ARGS="--cpu-ops" adds the requests' CPU ops to the profile (what each thread did between kernels)
#   SERVE_PROXY=haproxy: the serve level behind HAProxy with direct ingress (RAY_SERVE_ENABLE_HA_PROXY=1)
#   instead of Serve's HTTP proxy actor (docs/tuning.md, "The HTTP path")
#   AUTOSCALE_S=540 runs the live autoscaling ramp (bench/autoscale_live.py) alone (interrupted at
#   AUTOSCALE_S, it writes the part that ran, marked cut_short: leave ~40 s of the call after it): AUTOSCALE_GPUS (8)
#   logical GPUs of timed replicas (no GPU work, no model), time scale AUTOSCALE_SCALE (0.25: the
#   1,680 s ramp in 420 s, ~500 s with Ray's start and the plots; replicas start in the measured cold
#   start x 0.25), AUTOSCALE_ARGS adds flags;
#   its replicas start in the cold start COLD_S measured in this call or an earlier one of the same lease
#   (else bench/results'): COLD_S=110 COLD_RUNS=1 COLD_ARMS=first AUTOSCALE_S=420 AUTOSCALE_SCALE=0.2 fits one call;
#   it writes its run folder, autoscale-latest.json and fleet-sim-latest.json (sim_vs_live) under
#   results/ of capacity.tgz (docs/tuning.md, "The live ramp": how to bring them in)
# Timing on an H100 (2026-12-06): an in-process arm starts in 65-92 s (model, 430 flow + 143 vocoder
# + 71 decode graphs), a 60 s probe takes ~80 s, a one-session probe ~15 s + its window: an arm of
# one-session probe alone needs SYNTH_S >= 120 (95 s cut it), a compiled arm more (not known yet).
# Then, here: python -m bench.import_results <files_at>/capacity.tgz --tag <lease> [--latest]
# (the device names reports by level, card and day only: a second lease that day would overwrite).
set -u
W=/tmp/capacity
# a fresh folder per call: a warm machine keeps /tmp, and the night's third call packed and printed
# the second's results again (H100 2026-12-05)
rm -rf "$W" && mkdir -p "$W/results"
cp bench/results/latest.json "$W/results/"  # the tool adds its keys to the throughput benchmark's
# the call's own settings, for bench/import_results.py's run record (imports said
# "settings not recorded" and were filled by hand)
{ env | grep -E '^(TESTS_S|GPU_TESTS|AUTOSCALE_[A-Z]+|COLD_[A-Z]+|PROFILE_[A-Z]+|SYNTH_[A-Z]+|SERVE_[A-Z]+|ARMS|CAP_ARGS|CONFIG|FAMILY|TAG)=' | sort | sed "s/=\(.*\)/='\1'/" | tr '\n' ' '
  echo "bash bench/device_capacity.sh"; } > "$W/call.txt"
pack() { tar -czf "$OUT/capacity.tgz" -C "$W" .; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$W/gpu.txt"
cat "$W/gpu.txt"
# the carried serving stack (both levels import its config types) and the PyAV stand-in
source bench/device_site.sh
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
if [ "${TESTS_S:-0}" -gt 0 ]; then
  bash bench/device_gpu_tests.sh "$TESTS_S" "$W/gpu_tests.txt"
  pack
fi
if [ "${REPLICA_S:-0}" -gt 0 ]; then
  echo "REPLICA_S: the replica simulation is gone; measure arms of the product's replica with ARMS and SYNTH_S"
fi
full_model() {  # the full-size random-weight model directory of $FAMILY (serve and synth levels)
  F=${FAMILY:-cosyvoice2}
  [ -d "/tmp/$F-full" ] || python3 -m cosyvoice_runtime.tiny_model --size full --family "$F" --out "/tmp/$F-full" \
    > /dev/null 2>&1 || echo "full-size $F model: failed"
}
if [ "${COLD_S:-0}" -gt 0 ]; then  # a new replica's start: process start -> first request served
  full_model
  # The bench just wrote the full-size model (3.1 GB) and, on a fresh machine, unpacked the carry:
  # their dirty pages are flushed to disk beside the start unless synced first, which no node
  # starting a replica of a model downloaded earlier has. cold4 (fresh machine, not synced) ran every
  # phase at about half speed (H100 2026-12-07): the sync's time and the dirty pages say how much was left
  grep -E "^(Dirty|Writeback):" /proc/meminfo | tr -s ' ' | tr '\n' ' ' > "$W/sync.txt"
  s=$(date +%s%N); sync; echo "sync before the cold start: $(( ($(date +%s%N) - s) / 1000000 )) ms" >> "$W/sync.txt"
  cat "$W/sync.txt"; echo
  # COLD_ARMS="first all": each run once per synthesizer.graphs_before_ready value (the config with
  # that one key set), so the background capture and its baseline share a machine and a call
  arms="${COLD_ARMS:-config}"
  # twice: the first on a fresh machine (Triton compiles its kernels, the model file was just
  # written so it sits in the page cache), the second with Triton's cache warm
  for run in $(seq "${COLD_RUNS:-2}"); do
    for arm in $arms; do
      C="${CONFIG:-configs/single-gpu.yaml}"
      if [ "$arm" != config ]; then
        python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1]))
c['applications'][0]['args']['synthesizer']['graphs_before_ready'] = sys.argv[2]
yaml.safe_dump(c, open(sys.argv[3], 'w'))" "$C" "$arm" "/tmp/cold-$arm.yaml" && C="/tmp/cold-$arm.yaml"
      fi
      T="${TAG:+$TAG-}${COLD_ARMS:+$arm-}run$run"
      FAST_COSY_MODEL_DIR="/tmp/$F-full" timeout "$COLD_S" python3 -m bench.cold_start \
        --config "$C" --out "$W/results" --tag "$T" \
        --graphs-timeout-s "${COLD_GRAPHS_S:-$((COLD_S / 2))}" 2>&1 \
        | grep -v Warning > "$W/cold-$T.log"
      echo "== $T: $(grep -E "^cold start|Error|error" "$W/cold-$T.log" | cut -c1-600 | tail -3)"
      # kept outside $W for a later call of this lease (AUTOSCALE_S): the product's default arm only
      if [ "$arm" != all ]; then mkdir -p /tmp/cold-kept && cp "$W"/results/cold-start-*"$T".json /tmp/cold-kept/ 2>/dev/null; fi
    done
    pack
  done
fi
if [ "${AUTOSCALE_S:-0}" -gt 0 ]; then  # the live ramp (no model): after COLD_S when both are set, which sets its replicas' start
  cp bench/results/fleet-sim-latest.json "$W/results/"  # the tool writes its live comparison into it
  # a cold start measured by this call or an earlier one of this lease (COLD_S) sets the timed replicas' start
  cold=(); [ -d /tmp/cold-kept ] && cold=(--cold-starts /tmp/cold-kept)
  # SIGINT at AUTOSCALE_S: the tool writes what ran (cut_short) in the next ~30 s, then pack
  timeout -s INT -k 60 "$AUTOSCALE_S" python3 -m bench.autoscale_live --gpus "${AUTOSCALE_GPUS:-8}" ${cold[@]+"${cold[@]}"} \
    --time-scale "${AUTOSCALE_SCALE:-0.25}" --ingresses 2 --settle-s 120 ${AUTOSCALE_ARGS:-} --results "$W/results" \
    --latest ${TAG:+--tag "$TAG"} 2>&1 | grep -v Warning > "$W/autoscale.log"
  grep -E "run folder|Error|error|Traceback" "$W/autoscale.log" | cut -c1-600 | tail -8
  pack
fi
if [ "${PROFILE_S:-0}" -gt 0 ]; then
  full_model
  FAST_COSY_MODEL_DIR="/tmp/$F-full" timeout "$PROFILE_S" python3 -m bench.profile_first_audio --chrome \
    --sessions "${PROFILE_SESSIONS:-0}" ${PROFILE_ARGS:-} \
    --config "${CONFIG:-configs/single-gpu.yaml}" --out "$W/results" ${TAG:+--tag "$TAG"} 2>&1 \
    | grep -v Warning > "$W/profile.log"
  grep -E "request [0-9]|Error|error" "$W/profile.log" | cut -c1-300 | tail -12
  pack
fi
if [ "${SYNTH_S:-0}" -gt 0 ]; then  # the config's frontend + synthesizer in this process: no Ray, no HTTP
  full_model
  # SYNTH_CONFIGS="a.yaml b.yaml": one in-process run per config, SYNTH_S each, tagged with its name
  # (A/B arms on one machine in one call; each run also writes latest.json: keep the arm you mean)
  arms=()
  for a in ${ARMS:-}; do arms+=(--arm "$a"); done
  for C in ${SYNTH_CONFIGS:-${CONFIG:-configs/single-gpu.yaml}}; do
    # "a.yaml@190": this arm's own limit (a compiled arm compiles before its probes; the others
    # need less), else SYNTH_S
    S=$SYNTH_S; case $C in *@*) S=${C##*@}; C=${C%@*};; esac
    T=${TAG:-}
    [ -n "${SYNTH_CONFIGS:-}" ] && T="${T:+$T-}$(basename "$C" .yaml)"
    echo "== $C" >> "$W/synth.log"
    FAST_COSY_MODEL_DIR="/tmp/$F-full" timeout "$S" python3 -m bench.capacity --level synth --family "$F" \
      --config "$C" ${arms[@]+"${arms[@]}"} --out "$W/results" ${T:+--tag "$T"} ${CAP_ARGS:-} 2>&1 | grep -v Warning >> "$W/synth.log"
    pack
  done
  # start-up too: an arm cut before its first probe leaves only these lines (H100 2026-12-06)
  grep -E '^==|"kind"|done in|Error|error|ready on|captured|recompile_limit' "$W/synth.log" | cut -c1-900 | tail -30
fi
if [ "${SERVE_S:-0}" -gt 0 ]; then
  full_model
  [ "${SERVE_PROXY:-}" = haproxy ] && export RAY_SERVE_ENABLE_HA_PROXY=1
  # SERVE_ARMS="cold:;nocold:--cold-voice-share 0": one serve-level run per arm, SERVE_S each, with
  # CAP_ARGS and the arm's own flags, tagged TAG-NAME (an A/B of the workload in one call)
  IFS=';' read -ra serve_arms <<< "${SERVE_ARMS:-:}"
  for a in "${serve_arms[@]}"; do
    name=${a%%:*}; extra=${a#*:}; T="${TAG:-}${name:+${TAG:+-}$name}"
    # shellcheck disable=SC2086  # CAP_ARGS and the arm's flags split into words on purpose
    FAST_COSY_MODEL_DIR="/tmp/$F-full" timeout "$SERVE_S" python3 -m bench.capacity --level serve --family "$F" \
      --config "${CONFIG:-configs/single-gpu.yaml}" --out "$W/results" ${T:+--tag "$T"} ${CAP_ARGS:-} $extra 2>&1 \
      | grep -v Warning > "$W/serve${name:+-$name}.log"
    grep -E '"kind"|done in|Error|error' "$W/serve${name:+-$name}.log" | cut -c1-900 | tail -20
    python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1  # an arm cut by its timeout leaves Ray up
    pack
  done
fi
