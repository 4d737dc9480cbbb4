"""Before: the user's model and loop in BF16 (FP32 parameters under autocast), each block compiled; under torchrun with
several processes, sharded by FSDP2 as torchtitan shards it (loop.parallelize)."""

import torch

import loop
from loop import build_model, parse_args, train

args = parse_args()
model = build_model(args)
model = loop.parallelize(model, args)
optimizer = torch.optim.AdamW(model.parameters(), **args.adamw)
train(model, optimizer, args)
