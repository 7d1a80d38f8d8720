"""The causal depthwise short convolution (+ SiLU) of the mixers' q/k/v paths, time-first layout.

    y_t = b + sum_{j=0}^{k-1} w_j x_{t-(k-1)+j}      (x_s = 0 for s < 0),     out = SiLU(y) (optional)

``x (B, T, C)``, ``weight (C, k)``, ``bias (C)`` or None. Backends: ``reference`` (torch's ``conv1d``,
:mod:`.reference`) and ``triton`` (one kernel forward, one plus a reduction backward, :mod:`.triton`), the
GPU path. The CPU path is :mod:`mixers.conv_time_first` (shifted multiply-adds in time blocks sized for a
core's cache), which picks between the two paths by :func:`kernels.device.plan_for`.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .reference import causal_conv_reference

__all__ = ["BACKENDS", "causal_conv", "causal_conv_reference"]

#: the backends this family implements
BACKENDS = ("reference", "triton")


def causal_conv(x, weight, bias=None, activation: bool = True, backend: str = "auto"):
    """The short convolution of ``x (B, T, C)`` with ``weight (C, k)`` and ``bias (C)`` (or None)."""
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv: expected x (B, T, C) and weight (C, k) with the same C, got "
                         f"x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"causal_conv: bias must be (C,) = ({x.shape[-1]},), got {tuple(bias.shape)}")
    which = resolve_backend(backend, x, op="causal_conv", available=BACKENDS)
    if which == "triton":
        from .triton import causal_conv_triton  # lazy: triton is optional

        return causal_conv_triton(x, weight, bias, activation)
    return causal_conv_reference(x, weight, bias, activation)
