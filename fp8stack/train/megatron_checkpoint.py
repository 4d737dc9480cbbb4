"""The Megatron path's model and optimizer tensors in fp8stack checkpoints (checkpoint.TensorLayout): megatron-core's
own sharded state dicts, whose ShardedTensors carry each rank's shard with its global offsets, so a checkpoint of
any tensor- and data-parallel layout holds each tensor once, whole.

The pieces are megatron's torch_dist strategy's (dist_checkpointing.strategies.torch): save_preprocess /
load_preprocess (factories such as the SwiGLU fc1 split, non-persistent values, the common part), the grouping by
sharded key, mcore_to_pyt_state_dict (ShardedTensors as DCP items) and MCoreSavePlanner / MCoreLoadPlanner. What
differs is where they go: fp8stack's checkpoint writer (JSON metadata, the atomic rename, the rank files) in place of
megatron's, so loading unpickles nothing: DCP's non-tensor values (megatron's ShardedObjects: the distributed
optimizer's parameter groups and bucket sizes) are read weights-only, the common part travels in the rank files
(read weights-only too), and the modules' extra states (TE's FP8 scaling state) are left to the rank files as on the
plain path, each rank keeping its own.

The distributed optimizer's state is saved as megatron saves it by default (dp_reshardable: its FP32 master and
moment shards, bucket by bucket); the trainer's AdamW's as megatron's FP32Optimizer saves torch optimizers (each
moment a ShardedTensor shaped as its parameter, the step common; TE's FusedAdam, which keeps BF16 moments, hands them
out in FP32 and counts its step in the parameter groups, which are common too).
"""

import re
from collections.abc import Callable
from itertools import chain

import torch
from torch import nn

from fp8stack.precision.optimizer import keeps_step_per_group
from fp8stack.train.checkpoint import EXTRA_STATE_SUFFIX, CheckpointMismatchError
from fp8stack.train.dcp_json import WeightsOnlyLoadPlanner

DISTRIBUTED_OPTIMIZER_SHARDING = "dp_reshardable"
"""The distributed optimizer's checkpoint format (megatron's distrib_optim_sharding_type, Megatron-LM's default)."""
ADAMW_STEP = "common_step"
"""Where the trainer's AdamW's step (one for every parameter) is kept, as megatron's optimizers keep theirs."""


def is_extra_state(key: str) -> bool:
    """A module's extra state ('..._extra_state'), or one of the per-GEMM ones megatron's TE GroupedLinear adds to
    its sharded state dict ('..._extra_state1' to '..._extra_state<n-1>', beside '..._extra_state' for GEMM 0): the
    rank files keep them, in the module's own state_dict, where GroupedLinear holds all its GEMMs' in one."""
    return re.search(f"{EXTRA_STATE_SUFFIX}[0-9]*$", key) is not None


def _mcore_load_planner():
    """megatron's MCoreLoadPlanner (global shape checks) reading non-tensor values weights-only."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    class WeightsOnlyMCoreLoadPlanner(WeightsOnlyLoadPlanner, MCoreLoadPlanner):
        pass

    return WeightsOnlyMCoreLoadPlanner


class MegatronTensors:
    """checkpoint.TensorLayout of a megatron GPTModel and its optimizer: megatron's DistributedOptimizer, or a torch
    optimizer (the trainer's AdamW) over the model's parameters."""

    def __init__(self, module: nn.Module, optimizer):
        self.module = module
        """The GPTModel (unwrapped from DDP): its sharded state dict, and the extra states the rank files keep."""
        self.optimizer = optimizer

    def sharded_state_dict(self, is_loading: bool) -> dict:
        """{'model': the GPTModel's sharded state dict without its extra states, 'optimizer': the optimizer's}."""
        model = {key: value for key, value in self.module.sharded_state_dict().items() if not is_extra_state(key)}
        if isinstance(self.optimizer, torch.optim.Optimizer):
            optimizer = torch_optimizer_sharded_state_dict(self.optimizer, model, is_loading)
        else:
            optimizer = self.optimizer.sharded_state_dict(
                model, is_loading, metadata={"distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_SHARDING})
        return {"model": model, "optimizer": optimizer}

    def save_items(self):
        """Each sharded key once over all ranks (main replicas only), as DCP items with global offsets; the common
        part (parameter groups, steps) for the rank file."""
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

        sharded, common = save_preprocess(self.sharded_state_dict(is_loading=False))
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
        planner = MCoreSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        return mcore_to_pyt_state_dict(by_key, is_loading=False), common, planner

    def load_items(self) -> tuple[dict, object, Callable[[dict], None]]:
        """DCP items reading this rank's shards into place; put_in_place merges them with the common part
        saved beside them (megatron's serialization.load order) and loads model and optimizer."""
        from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
        from megatron.core.dist_checkpointing.strategies.torch import (
            _replace_sharded_keys_with_state_dict_keys, _replace_state_dict_keys_with_sharded_keys,
            _restore_dict_types, _unwrap_pyt_sharded_tensor, mcore_to_pyt_state_dict)
        from megatron.core.dist_checkpointing.utils import extract_sharded_base

        sharded, nonpersistent, factories = load_preprocess(self.sharded_state_dict(is_loading=True))
        sharded, _ = extract_sharded_base(sharded)
        by_key, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded)
        items = mcore_to_pyt_state_dict(by_key, is_loading=True)
        checked = [t for t in nested_values(sharded) if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        planner = _mcore_load_planner()(shapes_validation_sharded_tensors=checked, flatten_state_dict=False,
                                        flatten_sharded_tensors=False)

        def put_in_place(common: dict) -> None:
            loaded = {key: _unwrap_pyt_sharded_tensor(value) for key, value in items.items()}
            loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
            _restore_dict_types(loaded, sharded)
            state = merge(merge(common, nonpersistent), loaded)
            state = apply_factory_merges(state, factories)
            self._load(state)

        return items, planner, put_in_place

    def _load(self, state: dict) -> None:
        """The model's tensors (its extra states came from the rank file), then the optimizer's."""
        incompatible = self.module.load_state_dict(state["model"], strict=False)
        missing = [key for key in incompatible.missing_keys if not is_extra_state(key)]
        if missing or incompatible.unexpected_keys:
            raise CheckpointMismatchError(f"the checkpoint does not fit this model: missing {missing}, unexpected "
                                          f"{incompatible.unexpected_keys}; resume with the same model and plan")
        if isinstance(self.optimizer, torch.optim.Optimizer):
            load_torch_optimizer(self.optimizer, state["optimizer"])
        else:  # FP32 parameters' shards in the distributed optimizer are views of the parameters: copy without autograd
            with torch.no_grad():
                self.optimizer.load_state_dict(state["optimizer"])


def torch_optimizer_sharded_state_dict(optimizer: torch.optim.Optimizer, model_sharded: dict,
                                       is_loading: bool) -> dict:
    """A torch optimizer's state dict with each per-parameter tensor (Adam's moments) a ShardedTensor of its
    parameter's sharding, the step common: megatron's FP32Optimizer.sharded_state_dict for an optimizer megatron
    does not wrap. is_loading: zero moments are made first for an optimizer that has not stepped yet."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    params = list(chain.from_iterable(group["params"] for group in optimizer.param_groups))
    if is_loading:
        for param in params:
            if not optimizer.state[param]:
                _zero_state(optimizer, param)
    state = optimizer.state_dict()
    steps = {float(entry["step"]) for entry in state["state"].values() if "step" in entry}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's parameters are at different steps {sorted(steps)}: a checkpoint keeps one")
    step = next((entry["step"] for entry in state["state"].values() if "step" in entry), None)
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_sharded, params),
                                  exclude_keys=("step",))
    if step is not None:
        state["state"][ADAMW_STEP] = step.detach().cpu().clone()
    return state


def _zero_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Zero moments for `param` to load into, as the optimizer makes its own: TE's FusedAdam (BF16 moments) in its
    moments' dtype, its step kept in the parameter groups (which the common part restores); torch's AdamW in the
    parameter's dtype with a step of its own."""
    if keeps_step_per_group(optimizer):
        optimizer.initialize_state(param, store_param_remainders=False)
    else:
        optimizer.state[param].update(step=torch.zeros((), dtype=torch.float32, device=param.device),
                                      exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))


def load_torch_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state dict torch_optimizer_sharded_state_dict laid out (its common step given back to every
    parameter)."""
    step = state["state"].pop(ADAMW_STEP, None)
    if step is not None:
        for entry in state["state"].values():
            entry["step"] = step.clone()
    optimizer.load_state_dict(state)
