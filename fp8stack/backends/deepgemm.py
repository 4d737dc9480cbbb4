"""DeepGEMM adapter for the blockwise expert GEMMs. Optional: DeepGEMM is built from source
(github.com/deepseek-ai/DeepGEMM), so its absence is a reason string, never an import error.

It calls the functions torchao 0.18's blockwise MoE training calls (torchao/prototype/
blockwise_fp8_training/deepgemm_grouped_kernels.py), with FP32 scales (the Hopper kernels):
- forward and dgrad: m_grouped_fp8_gemm_nt_contiguous over expert-sorted rows, each expert's rows
  padded to the contiguous-layout alignment and labelled by `m_indices`;
- wgrad: k_grouped_fp8_gemm_nt_contiguous, the Hopper K-grouped FP8 kernel (DeepGEMM's
  k_grouped_fp8_gemm_tn_contiguous is the Blackwell one, with UE8M0 scales), whose operands are
  each expert's [dim, tokens] block stored K-major and flattened, scales [dim, token_blocks].
DeepGEMM moves the FP32 scales into its TMA-aligned layout itself (transform_sf_into_required_layout).
"""

import importlib.util
import itertools
import math
import os
import sys
from types import ModuleType

import torch
import torch.nn.functional as F

from fp8stack.backends import fp8_quant
from fp8stack.backends.base import BackendUnavailable
from fp8stack.backends.blockwise import BLOCK, Fp8Tensor, new_or_into

JIT_CACHE_ENV = "DG_JIT_CACHE_DIR"
"""The environment variable DeepGEMM's JIT compiler reads its kernel cache folder from (csrc/jit/compiler.hpp)."""

REQUIRED = ("m_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_nt_contiguous")
"""DeepGEMM functions the adapter calls."""


def load() -> tuple[ModuleType | None, str]:
    """(deep_gemm, '') or (None, why it cannot be used)."""
    try:
        library = importlib.import_module("deep_gemm")
    except Exception as err:  # ImportError, or an OSError / ABI error from its extension
        return None, (f"deep_gemm is not importable ({type(err).__name__}: {err}); build DeepGEMM against this "
                      "torch with fp8stack's launch/build_deepgemm.sh (make deepgemm; pip cannot, see the [deepgemm] "
                      "extra), or use the torch kernels")
    missing = [name for name in REQUIRED if not hasattr(library, name)]
    if missing:
        return None, (f"the installed deep_gemm lacks {', '.join(missing)}: install a DeepGEMM with "
                      "Hopper K-grouped FP8 GEMMs, or use the torch kernels")
    return library, ""


def use_jit_cache_dir(path: str) -> None:
    """Point DeepGEMM's JIT kernel cache at `path` (created if missing) before DeepGEMM is imported: its compiler
    reads the folder from the environment once. Refuses when deep_gemm is already imported with another folder."""
    folder = os.path.abspath(os.path.expanduser(path))
    current = os.environ.get(JIT_CACHE_ENV)
    if "deep_gemm" in sys.modules and current != folder:
        raise RuntimeError(f"deep_gemm was imported before fp8stack could set {JIT_CACHE_ENV}={folder} (it has "
                           f"{current or 'its default, ~/.deep_gemm'}): set deepgemm.jit_cache_dir before anything "
                           "imports deep_gemm, or export the variable yourself")
    os.makedirs(folder, exist_ok=True)
    os.environ[JIT_CACHE_ENV] = folder


def m_indices(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [rows]: the expert of each row of an expert-sorted row buffer whose groups end at `offsets`
    (int [E], cumulative), -1 for the rows past the last group (DeepGEMM skips their blocks). Computed on
    offsets' device with a static size: no host sync, so a CUDA graph can capture it."""
    row = torch.arange(rows, dtype=offsets.dtype, device=offsets.device)
    expert = torch.searchsorted(offsets, row, right=True, out_int32=True)
    return torch.where(expert < offsets.numel(), expert, -1)


def host_ints_on(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A few host integers on `device` without waiting for it: torch.tensor(..., device=cuda) copies from pageable
    memory and synchronises the stream, which drains the launch queue; through pinned memory the copy is
    non-blocking."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def _in_words(data: torch.Tensor, counts: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """(data [dim, tokens] as the units it is moved in, elements per unit): 8-byte words where it is contiguous and the
    token count and every group's are whole words (DeepGEMM's groups are 128-token multiples), else its elements,
    1-byte ones as bytes: torch copies a strided FP8 tensor one byte per element, ~8x slower than in words."""
    per_word = 8 // data.element_size()
    if per_word > 1 and data.is_contiguous() and all(n % per_word == 0 for n in (data.shape[1], *counts)):
        return data.view(torch.int64), per_word
    return (data.view(torch.uint8) if data.element_size() == 1 else data), 1


def flatten_k_grouped(data: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
    """[dim, tokens] -> 1-D: expert by expert, its [dim, expert_tokens] block, K (tokens) innermost.
    Each block is copied straight into place, one copy per expert, in 8-byte words where the counts allow (_in_words).
    One index_select of 128-byte pieces for all blocks at once ran several times longer on an H200 than these copies
    together (profiles/runs/2026-11-28-profile-deepseek-moe-medium-mixed-gather-h200, its gather kernels)."""
    dim = data.shape[0]
    out = data.new_empty(dim * sum(counts))
    source, per_word = _in_words(data, counts)
    target = out.view(source.dtype)
    start = 0
    for count in counts:
        words, first = count // per_word, start // per_word
        target[dim * first:dim * (first + words)].view(dim, words).copy_(source[:, first:first + words])
        start += count
    return out


@fp8_quant.fused(dynamic_dims=(0, 1))
def _gather_k_grouped(source: torch.Tensor, ends: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [dim * ends[-1]] <- source [dim, units] in the K-grouped layout, groups ending at `ends` (int64 [E],
    cumulative units): each position's source element computed from the group ends, no index tensor read. Every size
    is dynamic, so new group sizes and either operand's dim reuse one compiled kernel."""
    dim = source.shape[0]
    position = torch.arange(out.shape[0], device=out.device)
    # Expert e's block fills out[dim * start_e:dim * end_e], so position // dim lies in [start_e, end_e).
    expert = torch.searchsorted(ends, position // dim, right=True)
    start = F.pad(ends[:-1], (1, 0))[expert]
    # At least 1 at every position; the clamp is for the lanes past the end that Inductor's vectorised CPU kernels
    # divide too (uninitialised: a zero raises ZeroDivisionError there).
    count = (ends[expert] - start).clamp_min(1)
    local = position - dim * start
    return out.copy_(source[local // count, start + local % count])


def _word_groups(data: torch.Tensor, counts: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, list[int],
                                                                                   torch.Tensor]:
    """(data in the units it is moved in (_in_words), each group's width in those units, the groups' cumulative ends
    on data's device): what a one-kernel layout reads, the ends reaching the device without a host sync
    (host_ints_on)."""
    source, per_word = _in_words(data, counts)
    units = [count // per_word for count in counts]
    return source, units, host_ints_on(list(itertools.accumulate(units)), data.device)


def flatten_k_grouped_compiled(data: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
    """flatten_k_grouped's bytes from one compiled gather (on CUDA; eager elsewhere) instead of a copy per expert,
    each copy launched from the host: a host-bound step's GPU idles between them (GroupedFP8Config.wgrad_flatten
    names the profiles)."""
    source, units, ends = _word_groups(data, counts)
    out = source.new_empty(data.shape[0] * sum(units))
    if out.numel():  # a zero size would be a compiled graph of its own, for nothing to move
        _gather_k_grouped(source, ends, out)
    return out.view(data.dtype)


def flatten_k_grouped_triton(data: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
    """flatten_k_grouped's bytes from one hand-written Triton kernel (k_grouped_triton: whole token blocks of one
    expert per program, copied in 8-byte words where the counts allow), one launch per operand."""
    from fp8stack.backends.k_grouped_triton import flatten_k_grouped_tiles  # triton: only where this choice runs

    return flatten_k_grouped_tiles(*_word_groups(data, counts)).view(data.dtype)


TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def flatten_k_grouped_auto(data: torch.Tensor, counts: list[int] | tuple[int, ...]) -> torch.Tensor:
    """flatten_k_grouped's bytes by the Triton tile copy where Triton runs (CUDA operands, Triton importable), measured
    the fastest layout on one H200 (GroupedFP8Config.wgrad_flatten names the runs); by the copies elsewhere."""
    if data.is_cuda and TRITON_IMPORTABLE:
        return flatten_k_grouped_triton(data, counts)
    return flatten_k_grouped(data, counts)


WGRAD_FLATTENERS = {"auto": flatten_k_grouped_auto, "copies": flatten_k_grouped,
                    "compiled": flatten_k_grouped_compiled, "triton": flatten_k_grouped_triton}
"""grouped_fp8's wgrad_flatten choices (plan.recipes.WGRAD_FLATTENS): what lays out the K-grouped wgrad's operands."""


TMA_ALIGNED_FP32 = 4
"""FP32 scales per 16 bytes: DeepGEMM's TMA reads a scale column from a multiple of 16 bytes."""


def mn_major_scales(scale: torch.Tensor) -> torch.Tensor:
    """FP32 scales [MN, tiles] in the layout DeepGEMM's Hopper kernels read, MN-major with columns TMA-aligned:
    `scale` itself when laid out so (TE's columnwise 1x128 scales, sliced to any tile count), else one copy by torch.
    Given another layout, DeepGEMM transposes with a kernel it JIT-compiles per tile count, and the K-grouped wgrad's
    tile count follows the routing: a new compile for every new count."""
    mn, tiles = scale.shape
    column = -(-mn // TMA_ALIGNED_FP32) * TMA_ALIGNED_FP32
    if scale.stride() == (1, column):
        return scale
    out = torch.empty_strided((mn, tiles), (1, column), dtype=scale.dtype, device=scale.device)
    return out.copy_(scale)


class DeepGemmKernels:
    """The two grouped GEMMs of grouped_fp8's blockwise recipe, on DeepGEMM (sm90)."""

    name = "DeepGEMM"
    capturable = True
    """The forward reads nothing on the host: the rows' experts (m_indices) are computed on the GPU."""
    capturable_backward = False
    """The wgrad kernel takes the experts' token counts as a Python list, read on the host in the backward."""
    capture_note = ("forward capturable in a CUDA graph; the backward reads the expert token counts on the host "
                    "once (DeepGEMM's K-grouped wgrad takes them as a Python list): capture the forward only, or "
                    "use recipe rowwise for a capturable training step")

    def __init__(self, library: ModuleType | None = None, wgrad_flatten: str = "auto"):
        if wgrad_flatten not in WGRAD_FLATTENERS:
            raise ValueError(f"DeepGEMM wgrad_flatten={wgrad_flatten!r}: use one of {', '.join(WGRAD_FLATTENERS)}")
        self.wgrad_flatten = wgrad_flatten
        """What lays out the K-grouped wgrad's operands (WGRAD_FLATTENERS)."""
        self.flatten_k_grouped = WGRAD_FLATTENERS[wgrad_flatten]
        if library is None:
            library, why = load()
            if library is None:
                raise BackendUnavailable(why)
        # Keep the functions, not the module: a module attribute would make the model impossible to deepcopy.
        self.m_grouped_gemm = library.m_grouped_fp8_gemm_nt_contiguous
        self.k_grouped_gemm = library.k_grouped_fp8_gemm_nt_contiguous
        alignment = getattr(library, "get_mk_alignment_for_contiguous_layout", None) or \
            library.get_m_alignment_for_contiguous_layout
        self.row_alignment = math.lcm(BLOCK, int(alignment()))
        """Rows per expert group are padded to this: DeepGEMM's block_m, and whole 128-token tiles for wgrad."""

    def m_grouped(self, a: Fp8Tensor, b: Fp8Tensor, groups) -> torch.Tensor:
        """Row group e of a [R, K] (1x128 scales) times b[e]^T, b [E, N, K] (128x128 scales) -> [R, N] BF16.
        groups.offsets: int32 [E] end row of each group, on the GPU; rows past the last group are left unwritten."""
        rows = a.data.shape[0]
        out = torch.empty(rows, b.data.shape[1], dtype=torch.bfloat16, device=a.data.device)
        # No recipe: DeepGEMM infers 1x128 / 128x128 from the FP32 scale shapes (its legacy recipe).
        self.m_grouped_gemm(
            (a.data, a.scale), (b.data, b.scale), out, m_indices(groups.offsets, rows), disable_ue8m0_cast=True)
        return out

    def k_grouped(self, a: Fp8Tensor, b: Fp8Tensor, groups, into: torch.Tensor | None = None) -> torch.Tensor:
        """out[e] = a_e @ b_e^T over expert e's tokens: a [M, T], b [N, T], 1x128 scales along T -> [E, M, N] FP32;
        into: an FP32 [E, M, N] the products are added to in place (and returned) instead of a new zeroed one.
        groups.counts: tokens per expert (multiples of 128), read on the host."""
        # The Hopper kernel computes d = c + a @ b^T in place in d; DeepGEMM first copies c into d unless c is d,
        # so c is d: zeroed, or the buffer accumulated into (an expert without tokens adds nothing).
        ks = list(groups.counts)  # host values: DeepGEMM plans the K-grouped kernel on the CPU
        out = new_or_into(into, (len(ks), a.data.shape[0], b.data.shape[0]), a.data.device)
        # The operands may run past the groups (a static buffer): DeepGEMM takes exactly sum(ks) tokens.
        tiles = sum(ks) // BLOCK
        a_scale, b_scale = mn_major_scales(a.scale[:, :tiles]), mn_major_scales(b.scale[:, :tiles])
        self.k_grouped_gemm(
            (self.flatten_k_grouped(a.data, ks), a_scale), (self.flatten_k_grouped(b.data, ks), b_scale), out, ks,
            host_ints_on(ks, a.data.device, torch.int32), out, recipe=(1, 1, BLOCK))
        return out
