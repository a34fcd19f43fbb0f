#!/usr/bin/env bash
# A code change's A/B on one GPU machine in one call: the same command on the tree as sent ("new")
# and with the change reverted ("old"). Machines differ: the same in-process arm started in 61 to
# 103 s on the H100s of one night and its one-session first audio by ~18 ms (2026-12-06), so a
# change is judged only against its baseline from the same call. Config changes need no patch:
# bench/device_capacity.sh's SYNTH_CONFIGS runs arms of configs.
#
# Here, before the call (.ab/ is ignored by git, so it travels only when carried):
#   mkdir -p .ab && git diff <base> HEAD -- cosyvoice_runtime deployments > .ab/change.patch
# The call:
#   run(command="AB_CMD='bash bench/device_capacity.sh' SYNTH_S=200 CAP_ARGS='--no-sessions --no-open-loop' \
#       bash bench/device_ab.sh", carry=[".carry", ".ab"])
# AB_CMD runs with OUT=$OUT/new, then OUT=$OUT/old (its files come back under those folders; a call
# returns at most 8 files); the tree is restored afterwards, also when an arm fails (the call then
# exits with that arm's status).
set -u
P=${AB_PATCH:-.ab/change.patch}
if [ ! -s "$P" ]; then
  echo "device_ab: no $P (git diff <base> HEAD -- <paths> > $P, and carry .ab)" >&2
  exit 2
fi
if ! patch --dry-run -R -p1 -s < "$P" > /dev/null; then
  echo "device_ab: $P does not revert cleanly on this tree" >&2
  exit 2
fi
ROOT=$OUT
reverted=0
restore() { if [ "$reverted" = 1 ]; then patch -p1 -s < "$P" > /dev/null && reverted=0; fi; }
trap restore EXIT
mkdir -p "$ROOT/new" "$ROOT/old"
status=0
echo "== new (the tree as sent)"
OUT=$ROOT/new bash -c "$AB_CMD" || status=$?
patch -R -p1 -s < "$P" > /dev/null && reverted=1
echo "== old ($P reverted)"
OUT=$ROOT/old bash -c "$AB_CMD" || status=$?
restore
exit "$status"  # an arm's failure, after both arms ran
