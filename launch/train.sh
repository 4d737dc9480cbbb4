#!/usr/bin/env bash
# Train with torchrun on 1..N GPUs (or CPU processes with gloo): `fp8stack train` under torchrun, every option
# passed through (see `fp8stack train --help`). Examples:
#   launch/train.sh --model tiny --fp8-recipe tensorwise --train-iters 100
#   NPROC=8 launch/train.sh --config fastest --parallelism.data-parallel ddp   (fsdp, the default, shards)
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
  -m fp8stack train "$@"
