"""What each norm of a built model feeds, found by running one forward on a few tokens and recording which tensor
every torch call reads and writes (a TorchFunctionMode), never by module names.

Two patterns come out of it (description.NormFeed and SwiGLUFeed): a norm whose output only linears read, and a
norm whose output only an MLP module reads that computes down(silu(gate(x)) * up(x)), gate and up two linears or
two halves of one. What a norm computes (RMSNorm or LayerNorm) is checked on the traced input, not read from its
class. A norm whose output is read by anything else is reported with what reads it (description.Unfusable).

The forward runs without gradients, in eval mode, with the random streams forked and the buffers restored, so the
model is left as it was, and with every attention kernel allowed: a process restricted to one (cuDNN's, say) may
not run it on the trace's FP32 inputs.
"""

from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fp8stack.plan.description import NormFeed, Rows, SwiGLUFeed, Unfusable

TRACE_TOKENS = 8
"""Tokens in the traced forward: enough for every op to run, few enough to cost nothing."""
_SPLITS = ("chunk", "split", "tensor_split")
"""Calls that cut a fused gate/up output into its halves."""
_ATTENTION_KERNELS = (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION)


@dataclass
class _Call:
    """One torch call of the traced forward."""

    name: str
    func: Callable
    args: tuple
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


@dataclass
class _ModuleCall:
    """One module call: its first tensor input and its output."""

    input: torch.Tensor | None
    output: object


@dataclass
class _Trace:
    calls: list[_Call] = field(default_factory=list)
    modules: dict[str, list[_ModuleCall]] = field(default_factory=lambda: defaultdict(list))
    readers: dict[int, list[_Call]] = field(default_factory=lambda: defaultdict(list))
    """id(tensor) -> the calls that read it and wrote a tensor (a call returning its own input is no reader)."""


class _Recorder(TorchFunctionMode):
    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs and not any(o is i for o in outputs for i in inputs):
            call = _Call(getattr(func, "__name__", str(func)), func, args, inputs, outputs)
            self.trace.calls.append(call)  # keeps every tensor alive, so that no id is reused
            for tensor in {id(t): t for t in inputs}.values():
                self.trace.readers[id(tensor)].append(call)
        return out


def trace_feeds(model: nn.Module, norms: dict[str, nn.Module], linears: dict[str, nn.Module],
                example_input: object = None) -> tuple[tuple[NormFeed | SwiGLUFeed, ...], tuple[Unfusable, ...]]:
    """(feeds, unfusable) of `norms` (fqn -> module) into `linears` (fqn -> module) in one forward of `model`
    on `example_input` (default: TRACE_TOKENS token ids). A model whose forward fails on it gets one Unfusable for
    the whole model, saying so and how to pass another input."""
    try:
        trace = _run(model, example_input)
    except Exception as err:  # the user's forward: whatever it raises means only that there is no trace
        what = "example_input" if example_input is not None else f"{TRACE_TOKENS} token ids [1, {TRACE_TOKENS}]"
        return (), (Unfusable("", f"one forward on {what} raised {type(err).__name__}: {' '.join(str(err).split())}; "
                                  "pass describe_module(..., example_input=...) to find fusable norms"),)
    weights = {id(module.weight): fqn for fqn, module in linears.items()}
    feeds, unfusable = [], []
    for fqn, norm in norms.items():
        try:
            feeds += _feeds_of(trace, model, fqn, norm, weights)
        except _NotFusable as why:
            unfusable.append(Unfusable(fqn, str(why)))
    return tuple(feeds), tuple(unfusable)


class _NotFusable(Exception):
    """Why a norm's output cannot be fused with what reads it."""


def _run(model: nn.Module, example_input: object) -> _Trace:
    """One forward of `model` under the recorder, leaving the model as it was."""
    trace = _Trace()
    modes = {name: module.training for name, module in model.named_modules()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if example_input is None:
        example_input = torch.zeros((1, TRACE_TOKENS), dtype=torch.long, device=device)
    with ExitStack() as stack:
        for name, module in model.named_modules():
            stack.callback(module.register_forward_hook(_module_recorder(trace, name)).remove)
        stack.enter_context(torch.no_grad())
        stack.enter_context(sdpa_kernel(list(_ATTENTION_KERNELS)))
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                                  device_type=device.type))
        model.eval()
        try:
            with _Recorder(trace):
                model(*example_input) if isinstance(example_input, tuple) else model(example_input)
        finally:
            for name, module in model.named_modules():
                module.training = modes[name]
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    return trace


def _module_recorder(trace: _Trace, name: str):
    def record(module: nn.Module, args: tuple, output: object) -> None:
        first = next((a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), None)
        trace.modules[name].append(_ModuleCall(first, output))
    return record


def _feeds_of(trace: _Trace, model: nn.Module, fqn: str, norm: nn.Module,
              weights: dict[int, str]) -> list[NormFeed | SwiGLUFeed]:
    """The NormFeed of one norm, and its SwiGLUFeed when what it feeds is a SwiGLU MLP; _NotFusable if neither."""
    calls = trace.modules.get(fqn, [])
    if len(calls) != 1 or not isinstance(calls[0].output, torch.Tensor):
        raise _NotFusable(f"it runs {len(calls)} times in one forward" if len(calls) != 1
                          else "its output is not one tensor")
    normalization, eps = _normalization(norm, calls[0])
    out = calls[0].output
    readers = trace.readers.get(id(out), [])
    if not readers:
        raise _NotFusable("nothing reads its output")
    others = [c for c in readers if not _is_linear_call(c, out, weights)]
    if others:
        raise _NotFusable(f"its output is also read by {others[0].name}, which no fused module computes")
    linears = tuple(weights[id(c.args[1])] for c in readers)
    repeated = [name for name, n in Counter(linears).items() if n > 1 or len(trace.modules.get(name, [])) != 1]
    if repeated:
        raise _NotFusable(f"{repeated[0]} runs more than once in one forward")
    feeds: list[NormFeed | SwiGLUFeed] = [NormFeed(fqn, normalization, eps, linears)]
    swiglu = _swiglu(trace, model, out, readers, weights)
    if swiglu is not None:
        module, gate, up, down = swiglu
        feeds.append(SwiGLUFeed(fqn, normalization, eps, module, gate, up, down))
    return feeds


def _normalization(norm: nn.Module, call: _ModuleCall) -> tuple[str, float]:
    """('RMSNorm' | 'LayerNorm', eps) as the traced call computed it; _NotFusable when it is neither."""
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    eps = next((getattr(norm, a) for a in ("eps", "variance_epsilon") if hasattr(norm, a)), "missing")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise _NotFusable("it has no 1-D weight to fold into a fused module")
    if eps == "missing" or not (eps is None or isinstance(eps, float)):
        raise _NotFusable(f"{type(norm).__name__} has no float attribute eps to read its epsilon from")
    x, y = call.input, call.output
    eps = torch.finfo(x.dtype).eps if eps is None else eps  # nn.RMSNorm(eps=None): the input dtype's
    if y.device.type == "meta":  # no values to check: trust torch's norm classes; fusing needs real weights anyway
        for cls, name in ((nn.RMSNorm, "RMSNorm"), (nn.LayerNorm, "LayerNorm")):
            if isinstance(norm, cls):
                return name, float(eps)
        raise _NotFusable("the model is on 'meta', where what the norm computes cannot be checked")
    shape = (weight.shape[0],)
    candidates = {"LayerNorm": lambda: F.layer_norm(x.float(), shape, weight.float(),
                                                    None if bias is None else bias.float(), eps)}
    if bias is None:
        candidates["RMSNorm"] = lambda: F.rms_norm(x.float(), shape, weight.float(), eps)
    tolerance = 1e-5 if y.dtype == torch.float32 else 2e-2
    for name, reference in candidates.items():
        if torch.allclose(reference().to(y.dtype).float(), y.float(), rtol=tolerance, atol=tolerance):
            return name, float(eps)
    raise _NotFusable(f"{type(norm).__name__} computes neither RMSNorm nor LayerNorm of its input")


def _is_linear_call(call: _Call, x: torch.Tensor, weights: dict[int, str]) -> bool:
    return (call.func is F.linear and len(call.args) >= 2 and call.args[0] is x
            and isinstance(call.args[1], torch.Tensor) and id(call.args[1]) in weights)


def _only_reader(trace: _Trace, tensor: torch.Tensor) -> _Call | None:
    readers = trace.readers.get(id(tensor), [])
    return readers[0] if len(readers) == 1 else None


def _swiglu(trace: _Trace, model: nn.Module, x: torch.Tensor, readers: list[_Call],
            weights: dict[int, str]) -> tuple[str, Rows, Rows, str] | None:
    """(module, gate rows, up rows, down fqn) when `x` (read by the linear calls `readers`) feeds a SwiGLU MLP
    module whose parameters are exactly its projections' weights; else None."""
    halves = _gate_up_candidates(trace, readers, weights)
    if halves is None:
        return None
    for (gate_out, gate_rows), (up_out, up_rows) in (halves, halves[::-1]):
        act = _only_reader(trace, gate_out)
        if act is None or act.func is not F.silu:
            continue
        product = _only_reader(trace, act.outputs[0])
        if product is None or product.name != "mul" or _only_reader(trace, up_out) is not product:
            continue
        down = _only_reader(trace, product.outputs[0])
        if down is None or not _is_linear_call(down, product.outputs[0], weights):
            return None
        down_fqn = weights[id(down.args[1])]
        module = _mlp_module(trace, model, x, down.outputs[0], {gate_rows.fqn, up_rows.fqn, down_fqn})
        return (module, gate_rows, up_rows, down_fqn) if module is not None else None
    return None


def _gate_up_candidates(trace: _Trace, readers: list[_Call], weights: dict[int, str]):
    """The two (output, rows) halves the norm's readers produce: two linears, or one linear cut in two along its
    last dim; None otherwise."""
    if len(readers) == 2:
        return [(c.outputs[0], Rows(weights[id(c.args[1])], 0, c.args[1].shape[0])) for c in readers]
    if len(readers) != 1:
        return None
    linear_out = readers[0].outputs[0]
    fqn = weights[id(readers[0].args[1])]
    cut = _only_reader(trace, linear_out)
    if cut is None or cut.name not in _SPLITS or len(cut.outputs) != 2:
        return None
    widths = [o.shape[-1] for o in cut.outputs]
    if any(o.shape[:-1] != linear_out.shape[:-1] for o in cut.outputs) or sum(widths) != linear_out.shape[-1]:
        return None
    return [(cut.outputs[0], Rows(fqn, 0, widths[0])), (cut.outputs[1], Rows(fqn, widths[0], sum(widths)))]


def _mlp_module(trace: _Trace, model: nn.Module, x: torch.Tensor, y: torch.Tensor, linears: set[str]) -> str | None:
    """The module called on `x` that returned `y` and holds exactly the parameters of `linears` (no biases)."""
    for fqn, calls in trace.modules.items():
        if fqn in linears or len(calls) != 1 or calls[0].input is not x or calls[0].output is not y:
            continue
        module = model.get_submodule(fqn)
        params = {id(p) for p in module.parameters()}
        wanted = {id(model.get_submodule(name).weight) for name in linears}
        if params == wanted:
            return fqn
    return None
