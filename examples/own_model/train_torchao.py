"""The same with torchao's float8 training applied by hand, as torchtitan's float8 converter does: every linear but the
output head (its filter_fqns ["output"]). Under torchrun with several processes, torchtitan's tensorwise recipe with
FSDP2: the sharded weights cast to FP8 before their all-gather (enable_fsdp_float8_all_gather) and all their scales
computed in one all-reduce after each optimizer step (precompute_float8_dynamic_scale_for_fsdp), the two options
torchtitan's float8 guide gives its tensorwise FSDP command."""

import argparse
from dataclasses import replace

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

from loop import build_model, parallelize, parse_args, train


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The converted, compiled and (with several ranks) sharded model, and its AdamW."""
    model = build_model(args)
    fp8_all_gather = args.mesh is not None and args.recipe == "tensorwise"  # rowwise scales cannot be gathered
    config = replace(Float8LinearConfig.from_recipe_name(args.recipe), enable_fsdp_float8_all_gather=fp8_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "output")
    model = parallelize(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), **args.adamw)
    if fp8_all_gather:
        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return model, optimizer


if __name__ == "__main__":
    arguments = parse_args()
    train(*build(arguments), arguments)
