#!/usr/bin/env bash
# Train with torchrun on 1..N GPUs (or CPU processes with gloo), Megatron-style flags passed through
# to `python -m fp8stack.train` (see its --help). Examples:
#   launch/train.sh --model tiny --fp8-recipe tensorwise --train-iters 100
#   NPROC=8 launch/train.sh --model llama-1b-like --fp8-recipe tensorwise --fsdp-float8-all-gather
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC=8 launch/train.sh --fp8-recipe blockwise ...
# Environment: NPROC (processes per node, default 1), NNODES (default 1), NODE_RANK (default 0),
# MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500), PYTHON (default .venv/bin/python
# when present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/env.sh
exec "$PYTHON" -m torch.distributed.run \
  --nproc-per-node "$NPROC" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m fp8stack.train "$@"
