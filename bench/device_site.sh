# Sourced by the device scripts (device_capacity.sh, device_gpu_tests.sh, device_run.sh,
# device_serve.sh), from the repository root: the Python packages the lent image lacks (Ray
# Serve, pydantic, starlette, wetext, ...; bench/carry_bundle.sh, the run's `carry: [".carry"]`)
# on PYTHONPATH, extracted once per machine and bundle (~10 s; calls of one lease chain on a warm
# machine, which keeps /tmp). The image has no PyAV and its wheel does not fit the carry: an
# empty `av` module makes the ingress report mp3/opus/aac/flac unsupported; the probes and tests
# stream PCM (H100 2026-12-07: tests/serve_app/test_failover.py failed to import without it).
if [ -f .carry/site312.tar.xz ]; then
  stamp=$(md5sum < .carry/site312.tar.xz)
  if [ "$(cat /tmp/site/.stamp 2>/dev/null)" != "$stamp" ]; then
    rm -rf /tmp/site && mkdir -p /tmp/site && tar -C /tmp/site -xJf .carry/site312.tar.xz && echo "$stamp" > /tmp/site/.stamp
  fi
else
  echo "note: no .carry/site312.tar.xz (carry .carry): Ray Serve, pydantic and wetext are missing here"
fi
export PYTHONPATH=/tmp/site:$PWD
if ! python3 -c "import av" 2>/dev/null; then
  mkdir -p /tmp/noav/av && : > /tmp/noav/av/__init__.py && export PYTHONPATH=$PYTHONPATH:/tmp/noav
  echo "note: no PyAV here: compressed response formats are off for this run (PCM only)"
fi
