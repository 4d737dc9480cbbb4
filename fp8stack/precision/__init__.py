"""The optimizer side of low-precision training, for any model and loop: BF16 (or FP8) parameters with FP32 master
weights, FP32 main_grad accumulation (TE's fused weight-gradient GEMMs where TE runs, a hook elsewhere), and their
average over data-parallel replicas (DDP); FP32 sharded masters of FP8 weights under FSDP2; AdamW over the masters with
FP32 or BF16 moments (adamw).
Above the assembly: it asks the backends that converted a model what their weights need."""

from fp8stack.precision.data_parallel import DataParallelGradients
from fp8stack.precision.master_weights import MasterWeights
from fp8stack.precision.optimizer import MOMENTS, adamw
from fp8stack.precision.sharded_masters import ShardedMasterWeights

__all__ = ["DataParallelGradients", "MasterWeights", "MOMENTS", "ShardedMasterWeights", "adamw"]
