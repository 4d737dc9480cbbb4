"""The backend protocol: every FP8 (or BF16) implementation offers availability, conversion and the lifecycle its
converted modules need (what runs after an optimizer step or a checkpoint load, master weights' initial values and
gradient buffers, tensor-parallel styles, what must load early), so that callers never import a backend's internals."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle
from torch.optim.optimizer import register_optimizer_step_post_hook

from fp8stack.plan import Decision, Plan, PlanError


def swap_module(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    """Put `new` at `fqn`; returns the model (`new` itself when fqn is the root)."""
    if not fqn:
        return new
    parent, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
    return model


def check_plan_fits(model: nn.Module, decisions: Sequence[Decision], plan_name: str) -> None:
    """Every GEMM the decisions size has that size in `model`: a linear's (out, in) features, an expert parameter's
    [experts, n, k]; PlanError naming the first that differs (a plan made for another model)."""
    modules = dict(model.named_modules())
    for d in decisions:
        c, found = d.component, None
        module = modules.get(d.fqn)
        if c.kind in ("linear", "head", "router") and hasattr(module, "in_features"):
            found, wanted = (module.out_features, module.in_features), (c.n, c.k)
        elif c.kind == "expert":
            owner, _, leaf = d.fqn.rpartition(".")
            param = getattr(modules.get(owner), leaf, None)
            found = tuple(param.shape) if isinstance(param, torch.Tensor) else None
            wanted = (c.experts, c.n, c.k)
        if found is not None and found != wanted:
            raise PlanError(f"the plan for {plan_name} sizes {d.fqn} as {' x '.join(map(str, wanted))}, but this "
                            f"{type(model).__name__}'s is {' x '.join(map(str, found))}: make the plan from this model "
                            "(describe_module)")


_OPTIMIZER_STEPS = [0]
"""Optimizer steps taken in this process, counted by a global torch.optim post-step hook (count_optimizer_steps)."""


def count_optimizer_steps() -> None:
    """Count every torch.optim optimizer's steps from now on (once per process): a cached FP8 weight is cast again
    after any step, whichever optimizer and loop the user runs. The backends' FP8 weight caches (TE's modules,
    grouped_fp8's experts) register it when they are armed."""
    if getattr(count_optimizer_steps, "registered", False):
        return

    def count(*_optimizer_hook_args) -> None:
        _OPTIMIZER_STEPS[0] += 1

    register_optimizer_step_post_hook(count)
    count_optimizer_steps.registered = True


def optimizer_steps() -> int:
    """Optimizer steps counted so far (count_optimizer_steps): an FP8 weight cache keys on it beside the weights'
    versions, which fused optimizers (fused AdamW) leave alone."""
    return _OPTIMIZER_STEPS[0]


class BackendUnavailable(RuntimeError):
    """A plan assigns modules to a backend this machine cannot run; the message says why and what to do."""


@dataclass
class ConversionRecord:
    """What one backend did to a model: kept on the model by the assembly's stamp."""

    backend: str
    """Backend name."""
    converted: dict[str, str] = field(default_factory=dict)
    """fqn -> class name of the module that now runs it."""
    recipe: str = ""
    """Recipe the converted modules run with."""
    notes: list[str] = field(default_factory=list)
    """What a user should know about how the plan was honoured (kernels chosen, formats a kernel imposes)."""


class Backend:
    """One FP8 implementation (te, torchao, grouped_fp8) or bf16. Subclasses implement available() and convert();
    the lifecycle methods' defaults say "nothing to do"."""

    name: str
    """The plan's backend name."""

    @classmethod
    def prepare_process(cls) -> None:
        """Load now what must load before other libraries touch the GPU (called when fp8stack starts working in a
        process); failures are reported later by available()."""

    def available(self, recipes: Sequence[str] = ()) -> tuple[bool, str]:
        """(True, '') when it can run here, the plan's `recipes` for it included, else (False, why and how to fix)."""
        raise NotImplementedError

    def convert(self, model: nn.Module, decisions: list[Decision], plan: Plan) -> tuple[nn.Module, ConversionRecord]:
        """Swap exactly the modules named by `decisions` (copying weights bit-exactly) and run the plan's fusions for
        this backend; return the model (a new object only when the root itself was swapped) and what was done.
        Raises if any decision cannot be honoured: a backend never picks something else quietly."""
        raise NotImplementedError

    def after_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        """What must run after every optimizer step for the modules it converted in `model`; None: nothing."""
        return None

    def after_checkpoint_load(self, model: nn.Module) -> None:
        """Rebuild what the modules it converted in `model` keep outside the model from the state a checkpoint put in
        them (TE's amax registry from their restored delayed-scaling state). Callers call it once a checkpoint's
        tensors and extra states are all loaded into `model`, before its next forward (fp8stack.after_checkpoint_load
        does, for every backend of an assembled model)."""

    def take_master_values(self, model: nn.Module) -> dict[int, torch.Tensor]:
        """id(parameter) -> the FP32 values of each parameter it holds in low precision only (FP8 weights), the
        initial values of its optimizer master; the backend lets go of its copy."""
        return {}

    def hand_over_main_grads(self, model: nn.Module) -> None:
        """Master weights now own an FP32 main_grad per weight: modules that kept their own buffers stop pointing
        their weights' .grad at them, and modules that can add their weight gradients into main_grad start to."""

    def refuse_wrappers(self, *, tensor_parallel: bool, fully_shard: bool, keeps_gathered: bool = False) -> str | None:
        """Why this backend, as configured, cannot run its modules under the wrappers asked for (tensor parallelism,
        fully_shard, and whether fully_shard keeps the gathered parameters after forward), naming the fix; None when
        it can. Asked before anything is converted."""
        return None

    def refuse_recompute(self) -> str | None:
        """Why the modules it converted, as configured, cannot be recomputed in backward (activation checkpointing),
        naming the fix; None when they can. Asked before any module is wrapped for recompute."""
        return None

    def before_fully_shard(self, model: nn.Module, gathered_dtype: torch.dtype | None, *,
                           keeps_gathered: bool = False) -> list[str]:
        """Make the modules it converted in `model` ready for fully_shard, which replaces their parameters by sharded
        ones and all-gathers them in gathered_dtype (FSDP2's mixed-precision param_dtype; None: each parameter's
        own); keeps_gathered: the blocks keep their gathered parameters after forward (reshard_after_forward=False,
        the caller's micro-batches reuse them until the step's last backward). Returns notes for its conversion
        record. Raises NotImplementedError (the reason and the fix) for what cannot run sharded."""
        return []

    def after_fully_shard(self, model: nn.Module) -> None:
        """fully_shard has replaced the parameters of the modules it converted by sharded ones: let go of, or re-key
        to the sharded ones, whatever held the pre-shard parameters."""

    def tensor_parallel_style(self, module: nn.Module, kind: str, mesh: DeviceMesh, **layouts) -> ParallelStyle | None:
        """The style that shards `module` (one it converted) over `mesh` as `kind` ('colwise', 'rowwise' or
        'prepare_input', the latter for a module whose linears all run on this backend); None: torch's own style.
        Raises when the backend cannot shard its modules."""
        return None
