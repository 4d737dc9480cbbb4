"""Before: the user's model and loop in BF16 (FP32 parameters under autocast), each block compiled."""

import torch

from loop import build_model, parse_args, train

args = parse_args()
model = build_model(args)
if args.compile:
    for block in model.layers.values():
        block.compile()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=args.fused)
train(model, optimizer, args)
