"""The trainer's Megatron path (model.impl = "megatron"): the same model shape as a megatron-core GPTModel built
through fp8stack's block factory, tensor parallel with sequence parallelism over megatron's parallel_state, the
remaining ranks data-parallel.

It starts from the plain path's weights: the plain Llama is drawn as --model-impl torch draws it (same seed,
same device) and copied into megatron's layouts (load_llama_weights), each rank keeping its shard, so the two
implementations and every tensor-parallel degree start from the same function and TP=2 can be compared with
TP=1. Precision is the plain path's: FP32 parameters (the master weights the optimizer updates), activations
under torch.autocast, FP8 inside the TE modules the plan puts in FP8; or, with training.param_dtype bf16,
megatron's own mixed precision: BF16 parameters in Float16Module, FP32 masters in megatron's optimizer.
Megatron's DistributedDataParallel (FP32 main_grad buffers, reduced once per step) wraps the model when there are
data-parallel ranks, for gradient_accumulation_fusion, and for megatron's optimizer, which replaces the trainer's
AdamW with the distributed optimizer (optimizer.distributed) or BF16 parameters. Without it two of megatron's
finalize_model_grads duties are done here: the gradients of sequence-parallel norm weights are summed over the TP
group, and the gradient norm counts each TP-replicated parameter once; with it, finalize_model_grads and the
optimizer's own norm and clipping run.

An MoE model's routed experts may be split over data-parallel ranks (parallelism.expert_parallel, megatron's expert
model parallelism): each rank copies its own experts from the plain Llama and routes its own tokens over all
experts, the alltoall dispatcher sending each token to its expert's rank and back. Megatron's DDP reduces the expert
weights' gradients over the ranks holding the same experts only, scaled by 1 / data-parallel ranks like the others;
the gradient norm adds every rank's experts once; the expert bias moves by the token counts summed over all
data-parallel ranks, so the same global batch gives the same update at any expert-parallel degree.
"""

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8stack.backends import get_backend
from fp8stack.models import Llama, LlamaConfig
from fp8stack.plan import Plan
from fp8stack.plan.recipes import get_recipe, is_fp8
from fp8stack.config import ConfigError, JobConfig
from fp8stack.train.defaults import ADAM_BETAS, ADAM_EPS
from fp8stack.train.model import build_model, model_config

log = logging.getLogger(__name__)



def transformer_config(cfg: JobConfig, shape: LlamaConfig, fp8_format: str | None):
    """megatron's TransformerConfig for the plain Llama `shape` (dense or MoE) under cfg's FP8, tensor- and
    expert-parallel options."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, bf16 = cfg.parallelism.tensor_parallel, cfg.training.param_dtype == "bf16"
    fp8 = is_fp8(cfg.precision.recipe)
    try:
        return TransformerConfig(
            num_layers=shape.n_layers, hidden_size=shape.dim, num_attention_heads=shape.n_heads,
            num_query_groups=shape.n_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_dim,
            gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=shape.norm_eps,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            # FP32 master weights, as in the plain path, or BF16 ones whose FP32 masters megatron's optimizer keeps;
            # torch.autocast gives the activations their dtype. Built on the CPU without megatron's own draws:
            # gpt_model copies every weight from the plain Llama.
            params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16, use_cpu_initialization=True,
            perform_initialization=False,
            tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
            expert_model_parallel_size=cfg.parallelism.expert_parallel,
            **({"fp8": fp8_format, "fp8_recipe": cfg.precision.recipe} if fp8 else {}),
            **moe_fields(shape, fp8),
            fp8_margin=cfg.te.delayed_margin,
            first_last_layers_bf16=cfg.precision.first_last_layers_bf16,
            num_layers_at_start_in_bf16=cfg.precision.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=cfg.precision.num_layers_at_end_in_bf16,
            fp8_dot_product_attention=cfg.precision.fp8_attention)
    except (ValueError, AssertionError) as err:
        raise ConfigError(f"megatron-core refuses this configuration: {err}") from None


def moe_fields(shape: LlamaConfig, fp8: bool) -> dict:
    """TransformerConfig fields of `shape`'s MoE layers ({} for a dense model), routing as the plain MoE
    (fp8stack.models.moe.Router) routes, in the terms of megatron's topk_routing_with_score_function:

    - softmax, weights as scored: softmax over all experts, then the top k (moe_router_pre_softmax). With route_norm:
      softmax over the top-k logits (megatron's default order), the renormalised top k of the full softmax.
    - sigmoid: megatron renormalises the top-k weights whenever top_k > 1 (route_norm), dividing by their sum
      + 1e-20 where the plain router divides by the sum, and keeps a single weight as scored. Sigmoid weights as
      scored at top_k > 1, and route_norm at top_k 1 (a weight of 1), have no megatron form: refused.
    - moe_router_dtype fp32: the router GEMM in FP32 and the weights kept FP32 to the weighted sum (the plain router
      runs its GEMM in the activation dtype and scores in FP32).
    - megatron multiplies each token's weight into its expert's SwiGLU output before linear_fc2, the plain MoE into
      the expert's output: the same function, rounded differently in BF16 and FP8.
    - Balancing: sigmoid routers take DeepSeek-V3's aux-loss-free expert bias (moe_router_enable_expert_bias: added
      to the scores for the top-k choice only, moved by sign(mean load - load) x the plain MoE's rate,
      MoEConfig.expert_bias_rate, once per step from the step's token counts, as finalize_model_grads does; a rate
      of 0 turns it off). Softmax routers none: megatron's TransformerConfig refuses an expert bias on softmax
      scores, where the plain MoE balances them too. No auxiliary loss either way.

    Experts are grouped GEMMs (moe_grouped_gemm: TEGroupedMLP's TE GroupedLinear on the TE spec; the local spec, on
    a CPU, builds SequentialMLP whatever the flag says). The alltoall dispatcher: with one expert-parallel rank it
    only permutes, and unlike allgather it pads the routing map for FP8 (moe_router_padding_for_quantization: each
    expert's token count a multiple of 16, so TEGroupedMLP pads and unpads nothing), as megatron advises for FP8
    grouped GEMMs; the padding rows carry weight 0 and leave the expert-bias counts alone. The permutation is TE's
    fused one where TE runs (moe_permute_fusion)."""
    moe = shape.moe
    if moe is None:
        return {}
    sigmoid = moe.score_func == "sigmoid"
    if (moe.route_norm and moe.top_k == 1) or (sigmoid and not moe.route_norm and moe.top_k > 1):
        raise ConfigError(f"the MoE router ({moe.score_func} scores, top {moe.top_k}, route_norm {moe.route_norm}) "
                          "has no megatron-core form: megatron renormalises sigmoid top-k weights when top_k > 1 and "
                          "never a single weight: set the description's router route_norm to what megatron does, or "
                          "use --model.impl torch")
    from fp8stack.megatron import te_usable

    return {
        "num_moe_experts": moe.num_experts, "moe_router_topk": moe.top_k, "moe_ffn_hidden_size": moe.expert_ffn_dim,
        "moe_shared_expert_intermediate_size": moe.shared_ffn_dim or None,
        "moe_layer_freq": [int(shape.is_moe_layer(i)) for i in range(shape.n_layers)],
        "moe_router_score_function": moe.score_func, "moe_router_pre_softmax": not sigmoid and not moe.route_norm,
        "moe_router_dtype": "fp32", "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
        "moe_router_enable_expert_bias": sigmoid and moe.expert_bias_rate > 0,
        "moe_router_bias_update_rate": moe.expert_bias_rate,
        "moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall",
        "moe_router_padding_for_quantization": fp8, "moe_permute_fusion": te_usable(),
    }


def fp8_format(cfg: JobConfig) -> str:
    """precision.fp8_format, or the recipe's library default (hybrid for delayed and tensorwise; hybrid without FP8)."""
    recipe = cfg.precision.recipe
    return cfg.precision.fp8_format or (get_recipe(recipe).default_format if is_fp8(recipe) else "hybrid")


def build_plan(config, cfg: JobConfig, shape: LlamaConfig, arch: int) -> Plan:
    """The plan megatron's own flags give (plan_from_megatron_args), as a Megatron launch would."""
    from fp8stack.megatron import plan_from_megatron_args

    return plan_from_megatron_args(config, vocab_size=shape.vocab_size, seq_len=shape.seq_len, arch=arch,
                                   name=cfg.model.name)


def gpt_model(config, plan: Plan, llama: Llama, use_te: bool | None = None):
    """The GPTModel of `llama`'s shape on the CPU (untied embeddings and output, RoPE at the shape's base),
    holding this rank's shards of llama's weights. Megatron's parallel state must be initialised."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from fp8stack.megatron import block_spec

    shape = llama.config
    model = GPTModel(config=config, transformer_layer_spec=block_spec(config, plan, use_te=use_te),
                     vocab_size=shape.vocab_size, max_sequence_length=shape.seq_len,
                     position_embedding_type="rope", rotary_base=int(shape.rope_theta),
                     share_embeddings_and_output_weights=False)
    load_llama_weights(model, llama)
    route_in_the_weights_dtype(model)
    return model


def route_in_the_weights_dtype(model) -> None:
    """megatron's router GEMM (TE's general_gemm, under moe_router_dtype fp32) takes its input in the router weight's
    dtype, which megatron's own mixed precision (Float16Module) keeps equal to the activations'. FP32 parameters
    under autocast give it an FP32 weight and BF16 activations, which cuBLAS refuses: each router gets the
    activations in its weight's dtype (an FP32 GEMM, the one moe_router_dtype fp32 asks for)."""
    from megatron.core.transformer.moe.router import Router

    for module in model.modules():
        if isinstance(module, Router):
            module.register_forward_pre_hook(input_in_weight_dtype)


def input_in_weight_dtype(router, args: tuple) -> tuple | None:
    """A router's forward pre-hook: its hidden states cast to its weight's dtype where they differ."""
    hidden, *rest = args
    return None if hidden.dtype == router.weight.dtype else (hidden.to(router.weight.dtype), *rest)


def load_llama_weights(model, llama: Llama) -> None:
    """Copy the plain `llama`'s weights into megatron's GPTModel `model`, this rank's shard of each: the
    tensor-parallel ones (megatron's tensor_model_parallel attribute) split as megatron's CPU init splits
    them (partition_dim, and partition_stride pieces per rank: fc1 holds [gate_r; up_r]), the routed experts of this
    expert-parallel rank (local_experts), the rest whole.
    Names cover megatron's TE spec (input norms inside linear_qkv / linear_fc1) and its local spec."""
    from megatron.core import parallel_state

    experts = local_experts(llama.config)
    full = megatron_layout(llama, experts)
    names = [name for name, _ in model.named_parameters()]
    unknown = [name for name in names if name not in full]
    # Whole sizes, not counts: megatron holds each expert's weights apart, the plain MoE all experts in one.
    mapped = sum(full[name].numel() for name in names if name in full)
    held = sum(p.numel() for p in llama.parameters()) - other_ranks_expert_elements(llama, experts)
    if unknown or mapped != held:
        raise ValueError(f"load_llama_weights: the GPTModel's parameters ({mapped} elements whole) do not map one to "
                         f"one onto the {held} of the plain Llama's this rank holds (no source for {unknown}): build "
                         "it with transformer_config (no biases, untied output, RMSNorm) from the Llama's shape")
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            weight = full[name]
            if getattr(param, "tensor_model_parallel", False):
                dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
                pieces = weight.split(param.shape[dim] // stride, dim)
                weight = torch.cat(pieces[rank::size], dim)
            if weight.shape != param.shape:
                raise ValueError(f"load_llama_weights: {name} is {tuple(param.shape)} on this rank but the plain "
                                 f"Llama's shard is {tuple(weight.shape)}: build both from the same LlamaConfig")
            param.copy_(weight)


def local_experts(shape: LlamaConfig) -> range:
    """The routed experts this expert-parallel rank holds (megatron's MoELayer: a contiguous range, local expert i
    being global expert ep_rank x local + i): all of them at one expert-parallel rank, none for a dense model."""
    from megatron.core import parallel_state

    if shape.moe is None:
        return range(0)
    local = shape.moe.num_experts // parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * local
    return range(first, first + local)


def other_ranks_expert_elements(llama: Llama, experts: range) -> int:
    """Elements of the routed experts outside `experts`, over every MoE layer: what other expert-parallel ranks
    hold."""
    layers = [block.moe for i, block in enumerate(llama.layers) if llama.config.is_moe_layer(i)]
    per_expert = sum(moe.experts.w13[0].numel() + moe.experts.w2[0].numel() for moe in layers)
    return per_expert * (llama.config.moe.num_experts - len(experts)) if layers else 0


def megatron_layout(llama: Llama, experts: range) -> dict[str, torch.Tensor]:
    """`llama`'s full (unsharded) weights under the names and layouts of megatron's GPTModel, both specs'; of the
    routed experts only `experts`, numbered from 0 as the rank holding them numbers its local experts."""
    shape = llama.config
    if not shape.fused_projections:
        raise ValueError("megatron_layout maps Llamas with fused projections (wqkv, w13) only")
    full = {"embedding.word_embeddings.weight": llama.tok_embeddings.weight,
            "decoder.final_layernorm.weight": llama.norm.weight, "output_layer.weight": llama.output.weight}
    for i, block in enumerate(llama.layers):
        layer = f"decoder.layers.{i}"
        attention_norm, ffn_norm = block.attention_norm.weight, block.ffn_norm.weight
        full.update({
            f"{layer}.input_layernorm.weight": attention_norm,  # local spec
            f"{layer}.self_attention.linear_qkv.layer_norm_weight": attention_norm,  # TE spec
            f"{layer}.self_attention.linear_qkv.weight": qkv_layout(block.attention.wqkv.weight, shape),
            f"{layer}.self_attention.linear_proj.weight": block.attention.wo.weight,
            f"{layer}.pre_mlp_layernorm.weight": ffn_norm,
        })
        full.update(moe_layout(block.moe, f"{layer}.mlp", experts) if shape.is_moe_layer(i) else {
            f"{layer}.mlp.linear_fc1.layer_norm_weight": ffn_norm,
            # [w1 (gate); w3 (up)]: megatron's GLU applies the activation to the first half as well.
            f"{layer}.mlp.linear_fc1.weight": block.feed_forward.w13.weight,
            f"{layer}.mlp.linear_fc2.weight": block.feed_forward.w2.weight,
        })
    return full


def moe_layout(moe, mlp: str, experts: range) -> dict[str, torch.Tensor]:
    """The plain MoE's weights under megatron's MoELayer names `mlp`.*: the router (whole: every rank routes to every
    expert), the routed experts `experts`, each one's fc1 ([gate; up], as the plain w13 stacks them) and
    fc2 under TEGroupedMLP's names (linear_fc1.weight{j}) and SequentialMLP's (local_experts.{j}.linear_fc1.weight),
    j counting the rank's local experts from 0, and the shared expert (whole)."""
    full = {f"{mlp}.router.weight": moe.router.gate.weight}
    for j, expert in enumerate(experts):
        for gemm, weights in (("linear_fc1", moe.experts.w13), ("linear_fc2", moe.experts.w2)):
            full[f"{mlp}.experts.{gemm}.weight{j}"] = weights[expert]
            full[f"{mlp}.experts.local_experts.{j}.{gemm}.weight"] = weights[expert]
    if moe.shared_experts is not None:
        full[f"{mlp}.shared_experts.linear_fc1.weight"] = moe.shared_experts.w13.weight
        full[f"{mlp}.shared_experts.linear_fc2.weight"] = moe.shared_experts.w2.weight
    return full


def qkv_layout(wqkv: torch.Tensor, shape: LlamaConfig) -> torch.Tensor:
    """The plain [Q; K; V] rows in megatron's linear_qkv layout: per query group g, the rows of g's query
    heads, then k_g, then v_g (SelfAttention.get_query_key_value_tensors; Megatron-LM's Llama checkpoint
    loader writes the same). The plain Llama rotates adjacent pairs (2i, 2i+1) of each q/k head, megatron's
    RoPE (rotary_interleaved=False) the halves (i, i + head_dim/2) at the same frequency i, so each q/k head's
    rows are reordered evens-then-odds (the permutation of Meta's Llama -> Hugging Face's): q.k per head, and
    so attention, is unchanged."""
    groups, head_dim = shape.n_kv_heads, shape.head_dim
    q, k, v = wqkv.split([shape.n_heads * head_dim, groups * head_dim, groups * head_dim])

    def halves(w: torch.Tensor) -> torch.Tensor:
        heads = w.view(-1, head_dim, w.shape[-1])
        return torch.cat([heads[:, 0::2], heads[:, 1::2]], dim=1)

    per_group = [halves(q).reshape(groups, -1, wqkv.shape[-1]), halves(k), v.view(groups, head_dim, -1)]
    return torch.cat(per_group, dim=1).reshape(wqkv.shape)


def finish_grads(params: list[torch.nn.Parameter], max_norm: float, tp_group, expert_group=None) -> torch.Tensor:
    """After backward: sum the sequence-parallel norm weights' gradients over the TP group (each rank saw
    its part of the sequence), then the global FP32 gradient norm (each TP-replicated parameter counted
    once; the expert-parallel weights, which megatron marks allreduce=False, of every rank of expert_group, each
    holding its own experts), clipping to max_norm if > 0. Returns the norm as a device tensor (no host sync)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in params if p.grad is not None]
    for p in params:
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=tp_group)
    experts = [p.grad for p in params if not getattr(p, "allreduce", True)]
    counted = [p.grad for p in params if getattr(p, "allreduce", True) and param_is_not_tensor_parallel_duplicate(p)]
    squared = squared_norm(counted, params[0].device)
    dist.all_reduce(squared, group=tp_group)
    if experts:
        if expert_group is None:
            raise ValueError("finish_grads: the parameters include expert-parallel weights: pass megatron's expert "
                             "tensor-and-model-parallel group as expert_group")
        expert_squared = squared_norm(experts, params[0].device)
        dist.all_reduce(expert_squared, group=expert_group)
        squared = squared + expert_squared
    norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared FP32 2-norm of `grads` together (0 for none)."""
    return torch.nn.utils.get_total_norm(grads).square() if grads else torch.zeros((), device=device)


class ReadyGradsOptimizer:
    """megatron's optimizer as the trainer's step drives it: clip() reduces nothing itself (the caller ran
    finalize_model_grads) but hands the optimizer the gradients (its shards of them, distributed) and clips them,
    returning the norm the step checks; step() then applies the update (step_with_ready_grads: Adam on the FP32
    masters, copied into the parameters, all-gathered when distributed), so megatron's step() is split at the seam
    the trainer's non-finite check needs."""

    def __init__(self, megatron_optimizer):
        self.megatron = megatron_optimizer
        """megatron-core's DistributedOptimizer, or Float16OptimizerWithFloat16Params for BF16 parameters."""
        self.torch_optimizer: torch.optim.Optimizer = megatron_optimizer.optimizer
        """The Adam inside it, whose param_groups carry the learning rate (the trainer's LambdaLR schedules it)."""

    @property
    def param_groups(self) -> list[dict]:
        return self.megatron.param_groups

    def clip(self, max_norm: float) -> torch.Tensor:
        """The FP32 gradient norm over all ranks (each TP-replicated parameter once), the shards clipped to
        max_norm if > 0; a device tensor."""
        self.megatron.prepare_grads()
        norm = self.megatron.clip_grad_norm(max_norm) if max_norm > 0 else self.megatron.get_grad_norm()
        return torch.tensor(norm, dtype=torch.float32, device=torch.cuda.current_device())

    def step(self) -> None:
        self.megatron.step_with_ready_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.megatron.zero_grad(set_to_none)


@dataclass
class MegatronModel:
    """A built GPTModel and what the trainer's step needs from it."""

    model: torch.nn.Module
    """What the trainer runs: the GPTModel (this rank's shards), in Float16Module with BF16 parameters, in megatron's
    DistributedDataParallel with main_grads."""
    gpt: torch.nn.Module
    """The GPTModel itself."""
    plan: Plan
    """The plan its layers run."""
    seq_len: int
    """Tokens per sequence."""
    tp_group: object
    """megatron's tensor-parallel process group."""
    expert_group: object = None
    """megatron's expert tensor-and-model-parallel group (the ranks that hold each routed expert once between them)
    when the experts are split over ranks (parallelism.expert_parallel > 1); None otherwise."""
    main_grads: bool = False
    """The model is megatron's DistributedDataParallel (with_main_grads): gradients land in param.main_grad."""
    optimizer: ReadyGradsOptimizer | None = None
    """megatron's optimizer (optimizer.distributed, or BF16 parameters); None: the trainer's AdamW steps the FP32
    parameters."""

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (megatron's vocab-parallel one, FP32) of one batch."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.model(tokens, positions, None, labels=targets).float().mean()

    def no_sync(self) -> AbstractContextManager:
        """DDP's no_sync: backward passes inside leave the gradients unreduced (a step's micro-batches but the last)."""
        return self.model.no_sync() if self.main_grads else nullcontext()

    def clip(self, max_norm: float) -> torch.Tensor:
        """The step's gradients finished (DDP's reduction over the data-parallel ranks, sequence-parallel norm
        weights summed over TP) and their global FP32 norm, clipped to max_norm if > 0: by megatron's optimizer,
        or finish_grads over the parameters (DDP's buffers handed to AdamW as .grad)."""
        if self.optimizer is not None:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.model])
            return self.optimizer.clip(max_norm)
        params = list(self.model.parameters())
        if self.main_grads:
            self.model.finish_grad_sync()
            for p in params:
                p.grad = p.main_grad
        self.update_expert_bias()
        return finish_grads(params, max_norm, self.tp_group, self.expert_group)

    def update_expert_bias(self) -> None:
        """finalize_model_grads' step for routers with an expert bias, which it runs itself under megatron's
        optimizer: each bias moves towards balance by the token counts of the step (summed over the data-parallel
        ranks), and the counts start again at zero."""
        if not self.gpt.config.moe_router_enable_expert_bias:
            return
        from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                                    reset_model_temporary_tensors)

        _update_router_expert_bias([self.gpt], self.gpt.config)
        reset_model_temporary_tensors(self.gpt.config, [self.gpt])

    def after_optimizer_step(self) -> None:
        """The weights changed: megatron's TE linears cast them to FP8 on the first micro-batch of a step
        and reuse that copy until told a new step began, as megatron's training loop tells them; DDP's
        gradient buffers start the next step at zero, and so do the routers' token counts (passes without an
        optimizer step, the FP8 priming ones, leave counts that no bias update consumed)."""
        from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

        self.model.set_is_first_microbatch()
        if self.main_grads:
            self.model.zero_grad_buffer()
        reset_model_temporary_tensors(self.gpt.config, [self.gpt])

    def checkpoint_layout(self, optimizer: "torch.optim.Optimizer | ReadyGradsOptimizer"):
        """How checkpoint.save/load lay out this model's tensors and those of `optimizer` (the one the trainer steps:
        its AdamW, or this model's megatron optimizer): megatron's sharded state dicts
        (fp8stack.train.megatron_checkpoint)."""
        from fp8stack.train.megatron_checkpoint import MegatronTensors

        return MegatronTensors(self.gpt, optimizer.megatron if isinstance(optimizer, ReadyGradsOptimizer) else optimizer)


def with_main_grads(model: torch.nn.Module, config, fuse_wgrad: bool, distributed_optimizer: bool
                    ) -> torch.nn.Module:
    """`model` in megatron's DistributedDataParallel: FP32 main_grad buffers (grad_reduce_in_fp32) averaged over the
    data-parallel ranks once per step, reduce-scattered for the distributed optimizer. fuse_wgrad: its TE linears
    write weight gradients into the buffers from the wgrad GEMM. TE takes that option at construction from
    config.gradient_accumulation_fusion, which the output head's ColumnParallelLinear would refuse without apex's
    fused_weight_gradient_mlp_cuda; so the model is built without it, the TE modules are switched on here, and the
    head's gradient is added into its buffer by DDP's hook."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if fuse_wgrad:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

        linears = [m for m in model.modules()
                   if isinstance(m, TransformerEngineBaseModule) and hasattr(m, "fuse_wgrad_accumulation")]
        if not linears:
            raise ConfigError("gradient_accumulation_fusion needs TransformerEngine linears in the GPTModel, and "
                              "this one has none: install TransformerEngine or drop the option")
        for linear in linears:
            linear.fuse_wgrad_accumulation = True
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(config, ddp, module=model)


def megatron_optimizer(model: torch.nn.Module, cfg: JobConfig) -> ReadyGradsOptimizer:
    """megatron's optimizer over `model` (in DistributedDataParallel): the distributed one (optimizer.distributed,
    FP32 masters and moments, BF16 ones with optimizer.moments bf16, sharded over the data-parallel ranks), else for
    BF16 parameters Float16OptimizerWithFloat16Params (FP32 masters of each); with the trainer's hyperparameters: Adam with decoupled
    weight decay on matrices only, clipping at grad_clip. Its learning rate is the trainer's schedule (LambdaLR over
    torch_optimizer), not megatron's OptimizerParamScheduler, so the weight decay megatron's scheduler would set per
    group (wd_mult: 0 for norms) is set here once."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt, bf16 = cfg.optimizer, cfg.training.param_dtype == "bf16"
    config = OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                             adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], adam_eps=ADAM_EPS,
                             clip_grad=opt.grad_clip, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                             use_distributed_optimizer=opt.distributed, **precision_aware(opt.moments))
    # One optimizer: an MoE model's experts would get a second, which the trainer's schedule does not drive (refused)
    (optimizer,) = get_megatron_optimizer(config, [model]).chained_optimizers
    for group in optimizer.param_groups:
        group["weight_decay"] = opt.weight_decay * group["wd_mult"]
    return ReadyGradsOptimizer(optimizer)


def precision_aware(moments: str) -> dict:
    """megatron OptimizerConfig's fields for optimizer.moments: BF16 moments are its precision-aware optimizer (TE's
    FusedAdam inside the distributed optimizer), the masters kept whole in FP32 (not as remainders of the BF16
    parameters, megatron's default there), so the moments are the one change."""
    if moments == "fp32":
        return {}
    return {"use_precision_aware_optimizer": True, "exp_avg_dtype": torch.bfloat16,
            "exp_avg_sq_dtype": torch.bfloat16, "store_param_remainders": False}


@contextmanager
def build(cfg: JobConfig, env) -> Iterator[MegatronModel]:
    """Megatron's parallel state over the trainer's processes (TP groups of consecutive ranks, the rest
    data-parallel, in expert-parallel groups of consecutive data-parallel ranks), then the model on env.device; the
    state (and a one-rank process group made for it) is torn down on exit."""
    if env.device.type != "cuda":
        raise ConfigError("the Megatron model needs CUDA: megatron-core's GPTModel allocates its buffers, RoPE "
                          "and RNG on torch.cuda, and runs FP8 through TransformerEngine. Run it on a GPU, or "
                          "use --model-impl torch on a CPU")
    from megatron.core import parallel_state, tensor_parallel

    from fp8stack.megatron import te_usable

    shape = model_config(cfg)
    major, minor = torch.cuda.get_device_capability(env.device)
    config = transformer_config(cfg, shape, fp8_format(cfg))
    plan = build_plan(config, cfg, shape, arch=10 * major + minor)
    made_group = not dist.is_initialized()
    if made_group:  # a single process without torchrun: megatron still needs a (one-rank) group
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=env.device)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.parallelism.tensor_parallel,
                                                 expert_model_parallel_size=cfg.parallelism.expert_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed, te_rng_tracker=te_usable())
        # The plain Llama as --model-impl torch draws it (cfg.training.seed, on env.device: CUDA's generator).
        model = gpt = gpt_model(config, plan, build_model(cfg, env.device)).to(env.device)
        if cfg.te.blockwise_gemms == "deepgemm":  # megatron's TE linears call the general_gemm TE's own modules call
            log.info(get_backend("te", blockwise_gemms="deepgemm").route_blockwise_gemms())
        bf16 = cfg.training.param_dtype == "bf16"
        if bf16:  # megatron's mixed precision, as pretrain() wraps its model: BF16 in, FP32 logits and loss out
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        fuse_wgrad, distributed = cfg.te.gradient_accumulation_fusion, cfg.optimizer.distributed
        megatrons = distributed or bf16  # megatron's optimizer keeps the FP32 masters of BF16 parameters
        main_grads = env.dp_size > 1 or fuse_wgrad or megatrons
        if main_grads:
            model = with_main_grads(model, config, fuse_wgrad, distributed)
        yield MegatronModel(model=model, gpt=gpt, plan=plan, seq_len=shape.seq_len,
                            tp_group=parallel_state.get_tensor_model_parallel_group(),
                            expert_group=(parallel_state.get_expert_tensor_and_model_parallel_group()
                                          if cfg.parallelism.expert_parallel > 1 else None), main_grads=main_grads,
                            optimizer=megatron_optimizer(model, cfg) if megatrons else None)
    finally:
        parallel_state.destroy_model_parallel()
        if made_group:
            dist.destroy_process_group()
