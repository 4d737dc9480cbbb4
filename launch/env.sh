# Shared by launch/*.sh: defaults for torchrun, and the environment every fp8stack run needs.
NPROC="${NPROC:-1}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# NVLink multicast (NVLS) stays off in NCCL, torch symmetric memory and NVSHMEM: on a shared
# multi-GPU host a program using it can take the host's GPUs out of service for everyone.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
