#!/usr/bin/env bash
# A/B FP8 recipes against bf16 (`python -m fp8stack.ab`, the same as `fp8stack ab`), each arm a fresh
# torchrun job of NPROC processes on this node (arms must not share GPUs, so one node, one arm at a
# time). Flags pass through. Examples:
#   launch/ab.sh                                            # tiny model on the CPU, the README's run
#   NPROC=1 launch/ab.sh --model llama-1b-like --recipes bf16,tensorwise,rowwise --steps 200
#   NPROC=8 launch/ab.sh --model llama-1b-like --recipes bf16,tensorwise --backend te --steps 200
# Environment: NPROC (default 1), PYTHON (default .venv/bin/python when present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/env.sh
if [[ "$NNODES" != 1 ]]; then
  echo "launch/ab.sh: error: an A/B runs on one node (NNODES=$NNODES): run launch/train.sh per arm instead" >&2
  exit 2
fi
exec "$PYTHON" -m fp8stack.ab --nproc "$NPROC" "$@"
