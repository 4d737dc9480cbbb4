#!/usr/bin/env bash
# Device side: run several commands at once in one call to a lent GPU machine, each in a lane of its own (its own
# GPUs and its own copy of the checkout, so that benches writing profiles/runs/ never collide), all cut at one
# deadline inside the call's time limit, and bring back their evidence and logs as one archive ($OUT returns a few
# files only).
#   source scripts/gpu-lanes.sh SECONDS      # the deadline, from now
#   lane NAME GPUS 'command'                 # e.g. lane tests 0 'python -m fp8stack.bench.gpu_tests ...'
#   lane_seq NAME GPUS 'command' 'command'   # commands one after another in one lane
#   finish                                   # wait; $OUT/results.tgz: lanes-logs/ and the new profiles/runs files
# Evidence names the commit: export FP8STACK_COMMIT (and FP8STACK_DIRTY=0 for a clean tree) before sourcing; a lane's
# copy has no .git. PYTHONPATH puts /tmp/dgsite (DeepGEMM, launch/build_deepgemm.sh) and /tmp/site (the staged
# stack, scripts/stage-gpu.sh) before the lane's checkout. At the deadline a lane gets SIGTERM, and SIGKILL GRACE
# seconds later (default 10): `fp8stack ab --arm-checkpoints` needs the time its arms take to finish a step and save,
# and to write its evidence (GRACE=120, and a deadline that leaves that much of the call).
# The lanes' copies, logs and stamp go in $LANES_WORK (default /tmp).
START=$(date +%s)
DEADLINE=$((START + ${1:?seconds until the deadline}))
ROOT=$(pwd)
WORK=${LANES_WORK:-/tmp}
STAMP=$WORK/lanes-stamp-$START
LANES=""
mkdir -p "$WORK/lanes-logs"
touch "$STAMP"
sleep 1

lane() {
  local name=$1 gpus=$2 dir=$WORK/lane-$1
  shift 2
  if [ ! -d "$dir" ]; then
    mkdir -p "$dir"
    tar -C "$ROOT" --exclude=./.git --exclude=./.gpu --exclude=./.venv -cf - . | tar -C "$dir" -xf -
  fi
  local left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt 5 ] && left=5
  (
    cd "$dir" || { touch "$STAMP.$name.done"; exit 1; }
    echo "== $name start $(date +%T), ${left}s left: $*" >> "$WORK/lanes-logs/$name.log"
    CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/dgsite:/tmp/site:$dir FP8STACK_DIRTY=${FP8STACK_DIRTY:-0} \
      timeout -k "${GRACE:-10}" "$left" bash -c "$*" >> "$WORK/lanes-logs/$name.log" 2>&1 &
    local group=$! rc waited=0
    wait "$group"
    rc=$?
    # timeout returns as soon as its shell dies of the SIGTERM, while the shell's children that handle it (an A/B
    # saving its arms' checkpoints) still run in timeout's process group: the call must not end under them.
    while kill -0 -- "-$group" 2> /dev/null && [ "$waited" -lt "${GRACE:-10}" ]; do
      sleep 1
      waited=$((waited + 1))
    done
    kill -KILL -- "-$group" 2> /dev/null
    echo "== $name rc=$rc end $(date +%T)" >> "$WORK/lanes-logs/$name.log"
    touch "$STAMP.$name.done"
  ) &
  LANES="$LANES $name"
}

lane_seq() {
  local name=$1 gpus=$2 joined=""
  shift 2
  for command in "$@"; do joined="$joined ( $command ); echo \"-- step rc=\$?\";"; done
  lane "$name" "$gpus" "$joined"
}

finish() {
  # Each lane's done-file, not `wait`: finish run in a subshell (`finish | tail`) has no children to wait for, and
  # the call would end at once, its lanes killed with it.
  local name
  for name in $LANES; do
    while [ ! -e "$STAMP.$name.done" ]; do sleep 2; done
  done
  local files
  files=$(cd "$WORK" && find lane-*/profiles/runs -newer "$STAMP" -type f 2>/dev/null)
  # shellcheck disable=SC2086  # one path per word
  tar -C "$WORK" -czf "$OUT/results.tgz" lanes-logs $files
  for log in "$WORK"/lanes-logs/*.log; do echo "######## $log"; tail -n 25 "$log"; done
}
