"""The same with torchao's float8 training applied by hand (the output head kept in BF16)."""

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from loop import build_model, parse_args, train

args = parse_args()
model = build_model(args)
config = Float8LinearConfig.from_recipe_name(args.recipe)
convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "output")
if args.compile:
    for block in model.layers.values():
        block.compile()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=args.fused)
train(model, optimizer, args)
