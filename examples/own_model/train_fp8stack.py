"""After: the same model and loop through fp8stack, five lines changed: the plan (FP8 per GEMM, norms fused into what
they feed), the assembly (converted modules, compiled blocks, cuDNN attention on a GPU), BF16 parameters with FP32
masters, and the optimizer over the masters."""

import torch

import fp8stack
from loop import build_model, parse_args, train

args = parse_args()
model = build_model(args)
plan = fp8stack.make_plan(model, fp8stack.PolicyConfig(args.recipe, small_gemm_filter=args.small_gemm_filter), seq_len=args.seq_len)
model = fp8stack.assemble(model, plan, compile=args.compile, sdpa_backend=args.sdpa_backend, verbose=True)
masters = fp8stack.MasterWeights(model)
optimizer = masters.track(torch.optim.AdamW(masters.parameters(), **args.adamw))
train(model, optimizer, args)
