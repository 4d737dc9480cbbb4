"""TransformerEngine modules that run their forward under their own te.pytorch.autocast.

Imports TransformerEngine at the top: fp8stack.backends.te imports this module only once it knows
TE loads. One autocast region per module forward keeps the BF16 parts of the model out of FP8. What
it costs: TE reduces and updates delayed-scaling amaxes at every region exit (forward) and at the
end of every region's first module's backward, over all delayed-scaling modules registered with
the same recipe; so a model with N such modules launches N fused update kernels per forward and
N per backward instead of one each, and, when torch.distributed is initialized, N small amax
all-reduces each. Current-scaling and block-scaling recipes keep no amax state: no such cost.
ModelAutocast (TEBackend's one_autocast_per_forward) opens one region per forward of the whole
model instead, and the modules of its recipe then run without their own.
Recompute these modules with te.pytorch.distributed.checkpoint: it accepts autocast regions opened
inside the checkpointed function and replays delayed-scaling scales exactly (torch's checkpoint
would recompute with the already-updated scales).
"""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformer_engine.pytorch as te
from torch import nn
from transformer_engine.common.recipe import Recipe
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, get_align_size_for_quantization

from fp8stack.backends.base import count_optimizer_steps, optimizer_steps
from fp8stack.plan import PlanError


class _WeightCache:
    """Mixin: runs TE code under this module's FP8 autocast, with TE's is_first_microbatch driven as megatron's
    training loop drives it: with cached_weights, a forward casts the weights to FP8 and keeps the copy when an
    optimizer step (any torch.optim optimizer's) or an in-place write to a weight came since the last cast, and
    reuses the copy otherwise (the other micro-batches of a step); without, the weights are cast at every forward.
    Under fully_shard there is no cache unless the gathered weights stay for the step (TEBackend.before_fully_shard).
    With fuse_wgrad_accumulation it also keeps each weight's FP32 main_grad as its .grad (see _add_main_grads)."""

    cached_weights: tuple[nn.Parameter, ...] = ()
    """The weights whose FP8 casts are cached across micro-batches (empty: no cache)."""
    _cast_at: tuple | None = None
    """(optimizer steps, the weights' versions) when the cached copy was cast."""
    autocast_recipe: Recipe | None
    """The module's FP8 recipe; None runs it without FP8 (a bf16 plan on te)."""
    main_grad_weights: tuple[nn.Parameter, ...] = ()
    """With fuse_wgrad_accumulation: the weights whose wgrad GEMMs accumulate into their FP32 main_grad."""

    @torch.compiler.disable
    def _in_autocast(self, run, *args, **kwargs):
        """run(*args, **kwargs, [is_first_microbatch]) under an FP8 autocast with this module's recipe, outside
        torch.compile: dynamo breaks the graph inside TE modules anyway; DelayedScaling's amax and scale updates
        are side effects a compiled graph would not replay; and tracing into cached FP8 weights fails
        (AttributeError on Float8Tensor._data, seen under --compile on llama-1b-like)."""
        for weight in self.main_grad_weights:
            if weight.requires_grad and weight.grad is None:  # zero_grad(set_to_none=True) since: start anew
                weight.main_grad.zero_()
                weight.grad = weight.main_grad
        if self.cached_weights:
            # Fused AdamW writes the weights without bumping their versions: the step count catches it.
            now = (optimizer_steps(), tuple(w._version for w in self.cached_weights))
            kwargs["is_first_microbatch"] = now != self._cast_at
            self._cast_at = now
        if self.autocast_recipe is not None and _inside_region_of(self.autocast_recipe):
            return run(*args, **kwargs)
        with te.autocast(enabled=self.autocast_recipe is not None, recipe=self.autocast_recipe):
            return run(*args, **kwargs)

    def register_restored_scaling_state(self) -> None:
        """Once a checkpoint is loaded: register the TE modules' restored delayed-scaling state in TE's amax registry
        (FP8GlobalStateManager's global buffers) now, as the uninterrupted process has it, not at their first
        forward. Each autocast exit updates the scales of every registered module from its pending amaxes, and a
        checkpoint can hold pending forward amaxes: under fully_shard TE's backward casts a high-precision weight
        again with its forward quantizer (TE issue #2681), recording the weight's amax. The uninterrupted process
        applies them at the next step's first exit; registered only at its own forward, a module would apply them
        at its own exit, maxed with the new weight's amax, and its backward would cast with another scale."""
        if self.autocast_recipe is None or not self.autocast_recipe.delayed():
            return
        restored = [module for module in self.modules()
                    if isinstance(module, TransformerEngineBaseModule) and "scaling_fwd" in module.fp8_meta]
        # As a forward registers them, under the module's autocast; without grad its exit updates no scale.
        with torch.no_grad(), te.autocast(enabled=True, recipe=self.autocast_recipe):
            for module in restored:
                module.init_fp8_metadata(num_gemms=module.fp8_meta["num_gemms"])
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(module.fp8_meta)


def register_restored_scaling_states(model: nn.Module) -> None:
    """Each module this file builds (a _WeightCache) in `model` registers its restored delayed-scaling state with TE,
    once a checkpoint is loaded (TEBackend.after_checkpoint_load)."""
    for module in model.modules():
        if isinstance(module, _WeightCache):
            module.register_restored_scaling_state()


def _inside_region_of(recipe: Recipe) -> bool:
    """Whether an enclosing TE autocast region runs this very recipe object (ModelAutocast's): a module of it then
    runs there without a region of its own, whose exit would restore TE's first-module flag and give every module a
    backward update of its own."""
    return FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe() is recipe


class ModelAutocast:
    """One TE autocast region with `recipe` around each forward of a model: entered by a forward pre-hook on its root
    and left by its forward hook (always_call: also when the forward raises). The modules of that recipe run inside
    it (_inside_region_of), so delayed scaling reduces and updates their amaxes and scales once at the region's exit
    and once in backward (at the backward of the region's first FP8 module, the last to run backward), instead of
    once per module in each."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self._open: list[AbstractContextManager] = []

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)

    @torch.compiler.disable  # TE's global state changes here: a compiled model must not trace them
    def _enter(self, _module, _args) -> None:
        region = te.autocast(enabled=True, recipe=self.recipe)
        region.__enter__()
        self._open.append(region)

    @torch.compiler.disable
    def _leave(self, _module, _args, _output) -> None:
        self._open.pop().__exit__(None, None, None)


class _OwnAutocast(_WeightCache):
    """Mixin: the TE module's forward runs in _in_autocast."""

    def forward(self, *args, **kwargs):
        return self._in_autocast(super().forward, *args, **kwargs)


class TELinear(_OwnAutocast, te.Linear):
    """te.pytorch.Linear in its own FP8 autocast."""


class TELayerNormLinear(_OwnAutocast, te.LayerNormLinear):
    """te.pytorch.LayerNormLinear (the norm fused with the FP8 cast and GEMM) in its own FP8 autocast."""


class TELayerNormMLP(_OwnAutocast, te.LayerNormMLP):
    """te.pytorch.LayerNormMLP (norm, FC1, SwiGLU, FC2; the FP8 casts fused into the norm and, under
    delayed scaling, into the SwiGLU) in its own FP8 autocast."""


class TEGroupedExperts(_WeightCache, nn.Module):
    """fp8stack GroupedExperts on two te.pytorch.GroupedLinear: fc1 E x (D -> 2F) gate and up,
    fc2 E x (F -> D) down, SwiGLU between; the same forward(x_sorted [R, D], offsets [E]) -> [R, D]."""

    def __init__(self, num_experts: int, dim: int, hidden: int, *, recipe: Recipe | None, params_dtype: torch.dtype,
                 device: str, name: str, fuse_wgrad_accumulation: bool = False) -> None:
        super().__init__()
        # `recipe` sizes the groups here; _arm makes it the autocast recipe, as for the other TE modules.
        self.group_alignment = get_align_size_for_quantization(recipe) if recipe is not None else 1
        """MoE pads each expert's rows to this (FP8 GEMMs need 16 rows, MXFP8 32; BF16 none), read by MoE.forward."""
        self.fc1 = te.GroupedLinear(num_experts, dim, 2 * hidden, bias=False, params_dtype=params_dtype,
                                    device=device, name=f"{name}.fc1", fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.fc2 = te.GroupedLinear(num_experts, hidden, dim, bias=False, params_dtype=params_dtype,
                                    device=device, name=f"{name}.fc2", fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        # For callers whose groups are not aligned yet (a no-op after MoE's own padding), as Megatron does.
        self.pad = te.Fp8Padding(num_experts)
        self.unpad = te.Fp8Unpadding(num_experts)

    @torch.compiler.disable
    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """offsets: int32 end row of each expert's group; rows past offsets[-1] are padding (output zero).
        Eager in a compiled block: traced, the host's row counts would become constants of the graph, recompiled
        for every routing until dynamo gives up on the frame."""
        # TE splits the rows on the host: one device-to-host copy of the E counts per call.
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
        rows = sum(counts)
        out = self._in_autocast(self._experts, x_sorted[:rows], counts)
        padding = x_sorted.shape[0] - rows
        return F.pad(out, (0, 0, 0, padding)) if padding else out

    def cuda_graph_blocker(self, backward: bool) -> str:
        """Why this module cannot be captured in a CUDA graph, and what to do instead (one line)."""
        return ("TE GroupedLinear experts: not capturable in a CUDA graph: te.GroupedLinear takes the experts' row "
                "counts (m_splits) as a Python list, read on the host every forward; plan the experts on grouped_fp8 "
                "(recipe rowwise, or blockwise on DeepGEMM for a capturable forward) to capture them")

    def _experts(self, x: torch.Tensor, counts: list[int], is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, splits = self.pad(x, counts)
        gate, up = self.fc1(x, splits, is_first_microbatch=is_first_microbatch).chunk(2, dim=-1)
        return self.unpad(self.fc2(F.silu(gate) * up, splits, is_first_microbatch=is_first_microbatch), counts)

    def init_weights(self, init_std: float) -> None:
        """GroupedExperts.init_weights in this layout (the model's init_weights after building on 'meta')."""
        for e in range(self.fc1.num_gemms):
            nn.init.trunc_normal_(getattr(self.fc1, f"weight{e}"), std=0.02)
            nn.init.trunc_normal_(getattr(self.fc2, f"weight{e}"), std=init_std)


def linear_from(linear: nn.Linear, recipe: Recipe | None, name: str, cache_weights: bool = False,
                fuse_wgrad_accumulation: bool = False, fp8_weights: bool = False) -> TELinear:
    """A TELinear with `linear`'s shape, dtype, device and (bit-exact) weights; cache_weights: see _WeightCache;
    fuse_wgrad_accumulation: see _add_main_grads; fp8_weights: see _weights_built."""
    weight = linear.weight
    with _rng_kept(weight.device), _weights_built(recipe, fp8_weights, weight, name):
        new = TELinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                       params_dtype=weight.dtype, device=str(weight.device), name=name,
                       fuse_wgrad_accumulation=fuse_wgrad_accumulation, init_method=_set_to(weight))
    _arm(new, recipe, cache_weights, fuse_wgrad_accumulation, [new.weight], name)
    new.weight.requires_grad_(weight.requires_grad)
    if linear.bias is not None:
        _copy(new.bias, linear.bias)
    return new.train(linear.training)


@dataclass(frozen=True)
class Norm:
    """A norm to fold into the TE module after it: what it computes (RMSNorm or LayerNorm), its epsilon, the module."""

    normalization: str
    eps: float
    module: nn.Module


def layernorm_linear_from(norm: Norm, linears: list[nn.Linear], recipe: Recipe | None, name: str,
                          cache_weights: bool = False, fuse_wgrad_accumulation: bool = False,
                          fp8_weights: bool = False) -> TELayerNormLinear:
    """A TELayerNormLinear computing the `linears` (which read one input) of norm(x) as one GEMM, their outputs
    concatenated in order; weights copied bit-exactly. cache_weights: see _WeightCache; fuse_wgrad_accumulation: see
    _add_main_grads; fp8_weights: see _weights_built."""
    weight = _stacked([linear.weight for linear in linears], name)
    biases = [linear.bias for linear in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise PlanError(f"{name}: some of the merged projections have a bias and some not: run them unfused "
                        "(fuse_norm=False)")
    with _rng_kept(weight.device), _weights_built(recipe, fp8_weights, weight, name):
        new = TELayerNormLinear(weight.shape[1], weight.shape[0], eps=norm.eps, bias=biases[0] is not None,
                                normalization=norm.normalization, params_dtype=weight.dtype,
                                device=str(weight.device), name=name, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                                init_method=_set_to(weight))
    _arm(new, recipe, cache_weights, fuse_wgrad_accumulation, [new.weight], name)
    _copy_norm(new, norm, weight, name)
    new.weight.requires_grad_(linears[0].weight.requires_grad)
    if biases[0] is not None:
        _copy(new.bias, _stacked(biases, name))
    return new.train(linears[0].training)


def layernorm_mlp_from(norm: Norm, gate: torch.Tensor, up: torch.Tensor, down: nn.Linear, recipe: Recipe | None,
                       name: str, cache_weights: bool = False, fuse_wgrad_accumulation: bool = False,
                       fp8_weights: bool = False) -> TELayerNormMLP:
    """A TELayerNormMLP computing down(silu(gate x) * up x) of norm(x) (TE's SwiGLU gates with FC1's first half:
    FC1 = [gate; up]) for bias-free projections whose weights are `gate`, `up` (rows of a linear's weight) and
    `down`'s; weights copied bit-exactly. cache_weights: see _WeightCache; fuse_wgrad_accumulation: see
    _add_main_grads; fp8_weights: see _weights_built."""
    fc1 = _stacked([gate, up], name)
    dim, hidden = fc1.shape[1], gate.shape[0]
    with _rng_kept(fc1.device), _weights_built(recipe, fp8_weights, fc1, name):
        new = TELayerNormMLP(dim, hidden, eps=norm.eps, bias=False, normalization=norm.normalization,
                             activation="swiglu", params_dtype=fc1.dtype, device=str(fc1.device), name=name,
                             fuse_wgrad_accumulation=fuse_wgrad_accumulation, init_method=_set_to(fc1),
                             output_layer_init_method=_set_to(down.weight))
    _arm(new, recipe, cache_weights, fuse_wgrad_accumulation, [new.fc1_weight, new.fc2_weight], name)
    _copy_norm(new, norm, fc1, name)
    new.fc1_weight.requires_grad_(gate.requires_grad)
    new.fc2_weight.requires_grad_(down.weight.requires_grad)
    return new.train(down.training)


def _stacked(tensors: list[torch.Tensor], name: str) -> torch.Tensor:
    """The tensors concatenated along dim 0 (the one itself when alone), detached; one dtype and device."""
    if len({(t.dtype, t.device) for t in tensors}) > 1:
        raise PlanError(f"{name}: the projections merged into it differ in dtype or device: cast the model to one "
                        "dtype on one device first")
    return tensors[0] if len(tensors) == 1 else torch.cat([t.detach() for t in tensors])


def _copy_norm(new: nn.Module, norm: Norm, weight: torch.Tensor, name: str) -> None:
    """The norm's weight (and LayerNorm's bias) into the TE module's, which holds one dtype: the projections'."""
    module = norm.module
    if weight.device.type == "meta":
        raise PlanError(f"fusing a norm into {name} replaces the norm, so the model's init_weights could not reset it "
                        "later: convert after initialising the weights (not on 'meta'), or pass fuse_norm=False and "
                        "fuse_mlp=False to the policy")
    if module.weight.dtype != weight.dtype:
        raise PlanError(f"the norm before {name} holds {module.weight.dtype} and the projections {weight.dtype}; TE "
                        "keeps one dtype: cast the model to one dtype, or pass fuse_norm=False and fuse_mlp=False")
    _copy(new.layer_norm_weight, module.weight)
    if norm.normalization == "LayerNorm" and getattr(module, "bias", None) is not None:
        _copy(new.layer_norm_bias, module.bias)


def grouped_experts_from(experts: nn.Module, recipe: Recipe | None, name: str, cache_weights: bool = False,
                         fuse_wgrad_accumulation: bool = False) -> TEGroupedExperts:
    """A TEGroupedExperts holding `experts`' w13 [E, 2F, D] and w2 [E, D, F] one expert per GEMM, bit-exactly;
    cache_weights: see _WeightCache; fuse_wgrad_accumulation: see _add_main_grads."""
    w13, w2 = experts.w13, experts.w2
    num_experts, two_hidden, dim = w13.shape
    with _rng_kept(w13.device):
        new = TEGroupedExperts(num_experts, dim, two_hidden // 2, recipe=recipe, params_dtype=w13.dtype,
                               device=str(w13.device), name=name, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
    weights = [*new.fc1.parameters(), *new.fc2.parameters()]  # one weight per expert and GEMM, no biases
    _arm(new, recipe, cache_weights, fuse_wgrad_accumulation, weights, name)
    for e in range(num_experts):
        _copy(getattr(new.fc1, f"weight{e}"), w13[e])
        _copy(getattr(new.fc2, f"weight{e}"), w2[e])
    return new.train(experts.training)


def _arm(module: _WeightCache, recipe: Recipe | None, cache_weights: bool, fuse_wgrad_accumulation: bool,
         weights: list[nn.Parameter], name: str) -> None:
    """Set what _WeightCache reads: the recipe, the weights whose FP8 casts are cached (with cache_weights and an FP8
    recipe) and, with fuse_wgrad_accumulation, FP32 main_grads for the module's `weights` (see _add_main_grads)."""
    module.autocast_recipe = recipe
    if cache_weights and recipe is not None:
        count_optimizer_steps()
        module.cached_weights = tuple(weights)
    _add_main_grads(module, weights if fuse_wgrad_accumulation else [], name)


def _add_main_grads(module: _WeightCache, weights: list[nn.Parameter], name: str) -> None:
    """fuse_wgrad_accumulation: give each weight an FP32 main_grad, into which TE's weight-gradient GEMM
    accumulates (no BF16 gradient, dtype conversion or add per micro-batch, as under megatron's DDP), and which
    _WeightCache makes the weight's .grad; zeroed at the first forward after optimizer.zero_grad(set_to_none=True),
    zeroed in place by zero_grad(set_to_none=False). Across replicas fp8stack.precision's DDP averages main_grad; the
    assembly refuses fuse_wgrad_accumulation with FSDP or tensor parallelism, which reduce autograd's gradients."""
    for weight in weights:
        if weight.dtype != torch.float32 or weight.device.type != "cuda":
            raise PlanError(f"fuse_wgrad_accumulation: {name} holds {weight.dtype} weights on {weight.device}, and "
                            "the FP32 main_grad TE accumulates into becomes the weight's .grad, which needs FP32 "
                            "master weights on the GPU: keep the model FP32 (autocast casts the activations), "
                            "build it on the GPU, or turn fuse_wgrad_accumulation off")
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # FP8 weights too
    module.main_grad_weights = tuple(weights)


def _weights_built(recipe: Recipe | None, fp8_weights: bool, weight: torch.Tensor,
                   name: str) -> AbstractContextManager:
    """Where a module from weights like `weight` is built. fp8_weights, for an FP8 recipe: in TE's
    quantized_model_init, so that the module holds its weights in FP8 only (Float8Tensor, or the recipe's quantized
    tensor), quantized from the copied weights (_set_to), whose FP32 values TE keeps on the CPU for the optimizer's
    masters (get_high_precision_init_val; TEBackend.take_master_values takes them). Needs weights on the
    GPU. Without FP8 (recipe None) the weights stay as they are."""
    if not fp8_weights or recipe is None:
        return nullcontext()
    if weight.device.type != "cuda":
        raise PlanError(f"fp8_weights: {name} has its weights on {weight.device}, and TE quantizes FP8 weights when "
                        "it builds the module: build the model on the GPU, initialised (not on 'meta')")
    return te.quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=True)


def _set_to(source: torch.Tensor):
    """A TE init_method giving the weight `source`'s values bit-exactly (TE builds a module's weights with it; in
    quantized_model_init it quantizes them after). On 'meta' TE defers it, as it does its own initialisation. TE
    keeps a module's init_method for later reset_parameters calls, so this one lets go of `source` once used: the
    replaced module's weights are freed with it."""
    held = [source]

    def init(weight: torch.Tensor) -> None:
        if not held:
            raise RuntimeError("this TE module was converted from another module's weights, which it no longer "
                               "holds, so reset_parameters cannot restore them: build and convert the model again")
        with torch.no_grad():
            weight.copy_(held.pop())
    return init


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)
    dst.requires_grad_(src.requires_grad)


def _rng_kept(device: torch.device) -> AbstractContextManager:
    """TE modules initialise their weights randomly before we overwrite them; fork the RNG so that
    converting does not shift the random stream (a BF16 and an FP8 run from one seed stay comparable)."""
    if device.type != "cuda":
        return nullcontext()  # 'meta': TE defers initialisation, nothing is drawn
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.random.fork_rng(devices=[index], device_type="cuda")
