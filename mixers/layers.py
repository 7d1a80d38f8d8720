"""Building blocks shared by several mixers: RMSNorm, gated RMSNorm, causal short convolution with a
decode state, the Mamba-2 log-decay gate, and the weight-decay declaration every module makes where it
creates a parameter (:func:`no_weight_decay`, read by :func:`split_weight_decay`).

Log-decay gate (the Mamba-2 parameterisation; Dao & Gu, arXiv 2405.21060):
``g_t = -exp(A_log) * softplus(W_a x_t + dt_bias)``, ``A ~ U(1, 16)``,
``dt_bias = softplus^{-1}(dt)``, ``dt ~ logU(1e-3, 1e-1)`` floored at 1e-4.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import triton_pieces_for
from kernels.common import at_least_fp32, compute_dtype, linear_input_dtype  # noqa: F401  (re-exported)
from kernels.device import plan_for
from kernels.gate import log_decay, step_size
from kernels.grad_slots import split_in_place  # noqa: F401  (re-exported for the mixers)
from kernels.norm import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference

from .conv_time_first import causal_conv_time_first

#: module attribute holding the names of the module's own parameters declared undecayed
_UNDECAYED = "_no_weight_decay_names"


def no_weight_decay(module: nn.Module, *names: str) -> None:
    """Declare that the parameters ``names`` of ``module`` (its own, not its children's) are not decayed.

    Decayed are the weights of projections and convolutions; not decayed are norm
    gains and biases, biases, and the parameters of a recurrence (decay rates, step sizes, skip gains,
    transition logits, eigenvalues), which weight decay would pull towards a different dynamical system
    rather than towards a smaller function (mamba-ssm and flash-linear-attention do the same for
    ``A_log``, ``dt_bias`` and ``D``).

    The declaration is kept twice: ``p._no_weight_decay = True`` on each parameter (the mamba-ssm /
    flash-linear-attention convention that outside optimizers read), and the names on the module, which
    survive what rebuilds ``Parameter`` objects and drops their attributes (``copy.deepcopy``,
    ``load_state_dict(..., assign=True)``, ``to_empty``, swapped dtype conversion). A name that is a
    buffer (a frozen transition) or a parameter registered as ``None`` (an absent bias) is accepted and
    has nothing to declare.
    """
    for name in names:
        if name in module._parameters:
            if module._parameters[name] is not None:
                module._parameters[name]._no_weight_decay = True
        elif name not in module._buffers:
            raise ValueError(f"{type(module).__name__} has no parameter {name!r} to exclude from weight decay")
    setattr(module, _UNDECAYED, frozenset(getattr(module, _UNDECAYED, ())) | set(names))


def split_weight_decay(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """``(decayed, undecayed)``: the trainable parameters of ``model`` by name, split by their declarations
    (:func:`no_weight_decay`, or the bare ``p._no_weight_decay = True`` mark). A parameter shared by two
    modules (a tied embedding) is listed once, undecayed if either declares it."""
    undecayed_ids = set()
    for module in model.modules():
        for name in getattr(module, _UNDECAYED, ()):
            p = module._parameters.get(name)
            if p is not None:
                undecayed_ids.add(id(p))
    decayed, undecayed = {}, {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            declared = id(p) in undecayed_ids or getattr(p, "_no_weight_decay", False)
            (undecayed if declared else decayed)[name] = p
    return decayed, undecayed


def one_pass(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the GPU plan (:func:`kernels.device.plan_for`): every stage one pass (fused
    projections, normalisations and gates, Triton kernels) instead of the CPU's cache-sized pieces."""
    return plan_for(x).one_pass


#: the fused projection's row is padded with zero outputs to a multiple of this many elements: the parts are
#: read in place at the row's stride (the short convolution, gates, norms), and Triton vectorises such
#: loads only where it knows the stride divisible by 16 (an H200 ran the convolution's backward over a block
#: of a 4104-wide projection in twice the time of one over a 4112-wide one; scalar loads in its PTX)
_ROW_ALIGN = 16


def project(x: torch.Tensor, modules) -> list[torch.Tensor]:
    """``[m(x) for m in modules]`` for ``nn.Linear`` modules reading the same input; an entry may also be a
    list of bias-free modules, whose outputs come back side by side as one block.

    On the GPU plan (:func:`kernels.device.plan_for`) one matmul over all the concatenated weights, split into
    the parts (views): one matmul forward and two backward for the layer, where separate modules launch one and
    two each and the gradients of ``x`` are added up one by one. The biases are added to their parts, or by the
    matmul itself where the biased parts are at least half of its row (its bias gradient sums every column of
    the output gradient, a part's add only that part's; BD-LRU's transition logits, say, against a delta rule's
    one-per-head gates). The matmul's row is padded with zero weights to a multiple of ``_ROW_ALIGN`` outputs,
    dropped again, so that the token stride of every part is a multiple of 16. The CPU plan calls each module (a
    group: one matmul over its weights) as before: a wider matmul may round differently, and CPU results are
    kept as they were."""
    groups = [list(m) if isinstance(m, (list, tuple)) else [m] for m in modules]
    if any(len(g) > 1 and any(m.bias is not None for m in g) for g in groups):
        raise ValueError("project: a group of modules whose outputs come back as one block must be bias-free")
    if not plan_for(x).one_pass or len(groups) == 1:
        return [g[0](x) if len(g) == 1 else F.linear(x, torch.cat([m.weight for m in g])) for g in groups]
    sizes = [sum(m.out_features for m in g) for g in groups]
    biases = [g[0].bias for g in groups]
    in_matmul = 2 * sum(n for n, b in zip(sizes, biases) if b is not None) >= sum(sizes)
    parts = _fused_matmul(x, [m.weight for g in groups for m in g], sizes, biases if in_matmul else None)
    if in_matmul:
        return parts
    return [p if b is None else p + b.to(p.dtype) for p, b in zip(parts, biases)]


def project_parts(x: torch.Tensor, modules, sizes: list[int]) -> list[torch.Tensor]:
    """The outputs of bias-free ``nn.Linear`` modules reading the same input, side by side, cut into parts of
    ``sizes`` features, each within one module's outputs (a module's output may be cut into several parts).

    On the GPU plan one matmul split once (as :func:`project`): cutting :func:`project`'s part again would be
    a second split, whose backward concatenates the parts' gradients a second time. The CPU plan calls each
    module and cuts its output."""
    widths = [m.out_features for m in modules]
    if any(m.bias is not None for m in modules):
        raise ValueError("project_parts: the modules must be bias-free")
    ends, edges = set(itertools.accumulate(sizes)), list(itertools.accumulate(widths))
    if sum(sizes) != sum(widths) or not set(edges) <= ends:
        raise ValueError(f"project_parts: parts {sizes} must cut the modules' outputs {widths} without crossing "
                         "from one module into the next")
    if plan_for(x).one_pass:
        return _fused_matmul(x, [m.weight for m in modules], sizes)
    parts, i = [], 0
    for m, width in zip(modules, widths):
        cut = []
        while sum(cut) < width:
            cut.append(sizes[i])
            i += 1
        y = m(x)
        parts += list(y.split(cut, -1)) if len(cut) > 1 else [y]
    return parts


def _fused_matmul(x: torch.Tensor, weights: list[torch.Tensor], sizes: list[int],
                  biases: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """``x`` times the concatenated ``weights`` (plus the concatenated ``biases``, one entry per part, None for a
    part without, when given), split into parts of ``sizes`` outputs (views); the row padded with zero weights to
    a multiple of ``_ROW_ALIGN`` outputs, dropped again."""
    pad = -sum(sizes) % _ROW_ALIGN
    if pad:
        weights = weights + [weights[0].new_zeros(pad, weights[0].shape[1])]
    bias = None
    if biases is not None:
        bias = torch.cat([b if b is not None else weights[0].new_zeros(n) for b, n in zip(biases, sizes)]
                         + [weights[0].new_zeros(pad)])
    parts = split_in_place(F.linear(x, torch.cat(weights), bias), sizes + [pad] * bool(pad))
    return list(parts[:len(sizes)])


def keep_autocast_dtype(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` in ``x``'s dtype, unless ``t`` is already in the dtype linear layers compute in under autocast: there
    it stays. A mixer's core output before its output norm and projection, or its output before the residual
    add: raising it to ``x``'s fp32 costs a cast each way and gives the same values (the projection rounds the
    norm's fp32 output back down; the residual add computes in fp32 either way)."""
    return t if t.dtype == linear_input_dtype(x) else t.to(x.dtype)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in at least fp32 and returned in
    ``x``'s dtype. On the GPU plan one Triton kernel each way (:func:`kernels.norm.rms_norm`) instead of about
    six launches forward and ten backward: a model runs one before every mixer and state mixer.

    ``to_linear``: the output feeds one linear layer only (an MLP's input projection, the LM head, a mixer's fused
    projection), so on the GPU plan inside an autocast region it is returned in the autocast dtype, the cast the
    linear layer would make (the same values) done by the norm's kernel: the norm writes half the bytes, and the
    cast and its backward are two passes over the activations fewer. Outside autocast, on the CPU plan (where it
    would only move the cast) or for an input already in that dtype, nothing changes."""

    def __init__(self, dim: int, eps: float = 1e-6, to_linear: bool = False):
        super().__init__()
        self.eps = eps
        self.to_linear = to_linear
        self.weight = nn.Parameter(torch.ones(dim))
        no_weight_decay(self, "weight")  # a gain: decay would pull it to 0, not to the identity 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_pieces_for(x):
            out = linear_input_dtype(x) if self.to_linear else x.dtype
            return rms_norm(x, self.weight, self.eps, backend="triton", out_dtype=out)
        return rms_norm_reference(x, self.weight, self.eps)


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(z)``, normalising over the last dimension (per head when reshaped). On the GPU plan
    one Triton kernel each way (:func:`kernels.norm.gated_rms_norm`, the product computed in fp32 before the
    cast to ``x``'s dtype) instead of about eight launches forward and sixteen backward."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if triton_pieces_for(x):
            return gated_rms_norm(x, z, self.weight, self.eps, backend="triton")
        return gated_rms_norm_reference(x, z, self.weight, self.eps)


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over time (kernel ``k``), then SiLU (optional), computed in the
    ``(batch, time, channels)`` layout of the projections (:mod:`mixers.conv_time_first`); the parameters
    are an ``nn.Conv1d``'s.

    Decode state: the last ``k - 1`` inputs, shape ``(batch, channels, k - 1)``.
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: bool = True):
        super().__init__()
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=True)
        no_weight_decay(self.conv, "bias")  # the filter taps decay, the bias does not

    def _act(self, y: torch.Tensor) -> torch.Tensor:
        return F.silu(y) if self.activation else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"ShortConv: input must be (batch, time, {self.channels}), got {tuple(x.shape)}")
        w = self.conv.weight.squeeze(1).to(x.dtype)                      # (C, k)
        return causal_conv_time_first(x, w, self.conv.bias.to(x.dtype), self.activation)

    def init_state(self, batch_size: int, device=None, dtype=None) -> torch.Tensor:
        return torch.zeros(batch_size, self.channels, self.kernel_size - 1, device=device, dtype=dtype)

    def final_state(self, x: torch.Tensor) -> torch.Tensor:
        """The decode state after consuming ``x`` (B, T, C) from a zero state."""
        k1 = self.kernel_size - 1
        xt = x.transpose(1, 2)
        if xt.shape[-1] < k1:
            xt = F.pad(xt, (k1 - xt.shape[-1], 0))
        return xt[..., -k1:] if k1 > 0 else xt[..., :0]

    def step(self, x_t: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat([state, x_t.unsqueeze(-1)], dim=-1)  # (B, C, k)
        y = (window * self.conv.weight.squeeze(1)).sum(-1) + self.conv.bias
        return self._act(y), window[..., 1:]


class DecayGate(nn.Module):
    """Mamba-2 style per-head log decay ``g_t <= 0`` (returns ``g`` and the step size ``dt``)."""

    def __init__(self, d_model: int, n_heads: int, a_range=(1.0, 16.0), dt_range=(1e-3, 1e-1), dt_floor=1e-4):
        super().__init__()
        self.proj = nn.Linear(d_model, n_heads, bias=False)
        A = torch.empty(n_heads).uniform_(*a_range)
        self.A_log = nn.Parameter(torch.log(A))
        dt = torch.exp(torch.rand(n_heads) * (math.log(dt_range[1]) - math.log(dt_range[0])) + math.log(dt_range[0]))
        dt = dt.clamp(min=dt_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^{-1}(dt)
        # the decay rate and the step-size bias set the memory length: decaying them shortens it
        no_weight_decay(self, "A_log", "dt_bias")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.from_projection(self.proj(x))

    def log_decay(self, raw: torch.Tensor) -> torch.Tensor:
        """``g`` alone from ``raw = self.proj(x)``: on the GPU plan one Triton kernel each way
        (:func:`kernels.gate.log_decay`), where the formula below launches five forward and eight backward."""
        if triton_pieces_for(raw):
            return log_decay(raw, self.A_log, self.dt_bias, backend="triton")
        return self.from_projection(raw)[0]

    def step_size(self, raw: torch.Tensor, dt_max: float, out_dtype: torch.dtype) -> torch.Tensor:
        """``dt`` alone from ``raw = self.proj(x)``, capped at ``dt_max``, in ``out_dtype``: on the GPU plan one
        Triton kernel each way (:func:`kernels.gate.step_size`), where the formula below launches about six
        forward (``g`` among them, unused) and eight backward."""
        if triton_pieces_for(raw):
            return step_size(raw, self.dt_bias, dt_max, out_dtype, backend="triton")
        return self.from_projection(raw)[1].clamp(max=dt_max).to(out_dtype)

    def from_projection(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, dt)`` from ``raw = self.proj(x)`` (computed elsewhere, e.g. by :func:`project`)."""
        raw = at_least_fp32(raw)
        dt = F.softplus(raw + self.dt_bias.to(raw.dtype))
        g = -torch.exp(self.A_log.to(raw.dtype)) * dt
        return g, dt
