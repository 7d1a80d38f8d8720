"""Defective-Jordan SSM: a linear state-space layer whose transition is made of Jordan-like blocks.

Dadwal, "The Illusion of State: Sharp Memory-Decay Bounds in Linear State Space Models" (OpenReview
8Kg8lL3L58). The state is ``N`` blocks of size ``m``; per block, with ``N_m`` the nilpotent shift
(ones on the superdiagonal, ``(N_m h)_i = h_{i+1}``):

    A_t = lam_t I + c N_m                       (c = 1: the defective Jordan block J = lam I + N)
    h_t = A_t h_{t-1} + B x_t,     y_t = C h_t            (B, C learned linear maps, as in the paper)

``||A^k|| = Theta(k^{m-1} rho^k)``: a defective block keeps a ``k^{m-1}`` transient before the
exponential decay (a longer memory), at the price of coupling the state's components. For a constant block
``(lam I + c N)^k = sum_{j<m} binom(k, j) lam^{k-j} c^j N^j``.

Time index: the paper writes ``h_{t+1} = A h_t + B x_t``, ``y_t = C h_t``, so its ``y_t`` sees inputs up to
``x_{t-1}`` only. Here ``h_t`` takes ``x_t`` before the read (as every other mixer of this zoo: the layer's
output at ``t`` may use token ``t``): the paper's ``y_{t+1}`` is this layer's ``y_t``, the same impulse response
``C A^k B`` shifted by one step, so the decay bounds are unchanged.

Default ``decay = selective``: the layer sits in gated stacks (the paper's section 2.4 time-varying case, where
``lam_t`` is input dependent and the polynomial prefactor survives); ``decay = fixed`` with ``rho = 0.9`` is the
paper's experimental setting. ``state_norm`` defaults to ``none``; the paper's "+ LayerNorm" models are ``step``.

Options:

* ``decay = fixed``: ``lam_t = rho`` (the paper's time-invariant setting, ``rho = 0.9``);
  ``decay = selective``: ``lam_t = exp(g_t)`` per block, ``g_t`` the Mamba-2 log-decay gate
  (:class:`mixers.layers.DecayGate`), the gated case of the paper's section 2.4.
* ``init``: ``diagonal`` (``c = 0``: ``A = rho I``), ``defective`` (``c = 1``: ``A = rho I + N``) or
  ``hippo``: a dense block ``A = I + (1 - rho) H / ||H||_2`` with the simplified HiPPO-LegS matrix
  ``H_ij = -sqrt((2i+1)(2j+1))`` (i > j), ``H_ii = -(i+1)``, 0 above the diagonal (the paper's
  appendix G.2; "normalised" read as unit spectral norm). ``hippo`` needs ``decay = fixed`` (the
  paper's setting) and runs through the dense :func:`kernels.blockscan.block_scan`; its eigenvalues
  are ``1 - (1 - rho)(i+1)/||H||_2``, distinct, so it is diagonalisable.
* ``learn_transition``: learn the coupling ``c`` (one per block; ``diagonal``/``defective``) or the
  whole dense block (``hippo``) by gradient descent; ``lam`` follows ``decay``.
* ``state_norm``:
  ``step`` — the paper's LayerNorm on the hidden state at every step, ``h_t = LN(A_t h_{t-1} + B x_t)``
  with the norm over the ``m`` components of each block (:func:`kernels.blockscan.jordan_scan_normed`).
  This is the setting that REPRODUCES the paper's "+ LayerNorm" models; it is nonlinear, so the scan
  is sequential (the kernel's recurrent scan, not chunk-parallel), and it needs ``m >= 2``.
  A block whose pre-norm state has zero variance (exactly zero input from the start with the norm's bias at
  its initial 0, as in runs of zero padding) passes gradients through the norm's Jacobian ``1/sqrt(norm_eps)``
  at every step: the exact gradient grows like ``(|A| / sqrt(norm_eps))^T`` along such a run (``~316^T`` at
  ``norm_eps`` 1e-5; fp32 overflows after about 14 steps), while inputs off exact zero keep it bounded
  (inputs of size 1e-4 over 64 steps gave gradients ~1e6, of size 1e-2 ~3e3). Keep runs of exact zeros
  out of its input, or raise ``norm_eps``.
  ``readout`` — the parallel alternative: the linear scan unchanged and ``y_t = C LN(h_t)``; it hides
  large states from the output but does not stop them from growing.
  ``none`` — no norm (``y_t = C h_t``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.blockscan import (
    BACKENDS,
    block_scan,
    block_scan_step,
    jordan_scan,
    jordan_scan_normed,
    jordan_step,
    jordan_step_normed,
    jordan_transition,
)

from .base import Mixer, State, register_mixer
from .layers import DecayGate, at_least_fp32, compute_dtype, no_weight_decay, one_pass, project
from .options import backend_opt, chunk_size_for, chunk_size_opt, opt


def hippo_legs_block(m: int, rho: float, dtype=torch.float64) -> torch.Tensor:
    """The discretised simplified HiPPO-LegS block ``I + (1 - rho) H / ||H||_2`` of size ``m``."""
    i = torch.arange(m, dtype=dtype)
    H = -torch.sqrt((2 * i[:, None] + 1) * (2 * i[None, :] + 1)).tril(-1) - torch.diag(i + 1)
    return torch.eye(m, dtype=dtype) + (1 - rho) * H / torch.linalg.matrix_norm(H, ord=2)


def _projects_in_fp32(weight: torch.Tensor) -> bool:
    """Whether the projections around the scan compute in fp32: an fp16 weight, or fp16 autocast over any weight
    (fp16's range ends at 65504); they then run outside autocast.

    The scan runs in fp32 and its state is unnormalised: with ``c != 0`` a block's ``||A^k||`` keeps a
    ``k^{m-1}`` transient (``binom(k, m-1)`` for ``lam`` near 1), so ``|h|`` grows about like ``T^{m-1}`` over
    ``T << 1/(1 - lam)`` tokens, and so do the gradients that reach ``b`` and the gate from it. In an fp16 model
    the state rounded to fp16 for ``C`` overflowed where ``y = C h`` itself fits (``|h|`` ~4x ``|y|`` at
    ``d_model`` 32, ``m = 4``: 9.7e4 against 2.5e4 after 96 tokens), and the gradient of ``b = B x`` rounded to
    fp16 overflowed where the input gradient fits (1.2e5 against 2.1e4 after 64 tokens). So ``B``, the gate's
    projection and ``C`` take fp32 there, ``x`` and ``y`` stay fp16; what still overflows is a value that does
    not fit fp16 itself (``y``, ``dx`` or a parameter's gradient). bf16 has fp32's range: its 16-bit
    projections are kept."""
    device = weight.device.type
    return weight.dtype == torch.float16 or (torch.amp.is_autocast_available(device)
                                             and torch.is_autocast_enabled(device)
                                             and torch.get_autocast_dtype(device) == torch.float16)


@register_mixer
class Jordan(Mixer):
    name = "jordan"
    input_to_linear = True     # x enters through the gate's and input projections, one matmul on the GPU plan
    description = "defective-Jordan SSM: blocks lam_t I + c N, fixed or selective decay, optional per-step LayerNorm"
    state_formula = "n_blocks * block_size  (constant in T)"

    @dataclass
    class Options:
        block_size: int = opt(4, "block size m of the Jordan blocks", at_least=1)
        n_blocks: int | None = opt(None, "number of blocks N (default d_model // block_size)", at_least=1)
        decay: str = opt("selective", "lam_t: 'fixed' = rho (time-invariant, the paper) or 'selective' = exp(g_t), "
                                      "Mamba-2 gate",
                         choices=("fixed", "selective"))
        rho: float = opt(0.9, "the fixed decay lam (decay=fixed) and the HiPPO step (1 - rho)", above=0.0, below=1.0)
        init: str = opt("defective", "transition at init: diagonal (c=0), defective (c=1), hippo (dense HiPPO-LegS block)",
                        choices=("diagonal", "defective", "hippo"))
        learn_transition: bool = opt(True, "learn the coupling c (or the dense HiPPO block)")
        state_norm: str = opt("none", "LayerNorm of the state: 'step' (every step, sequential; the paper), "
                                      "'readout' (y = C LN(h), parallel) or 'none'",
                              choices=("none", "step", "readout"))
        norm_eps: float = opt(1e-5, "LayerNorm epsilon", above=0.0)
        chunk_size: int | None = chunk_size_opt("blockscan", "chunk length of the chunked scan (does not change the result)")
        backend: str = backend_opt(BACKENDS)

        def __post_init__(self):
            if self.init == "hippo" and self.decay != "fixed":
                raise ValueError("init=hippo is the paper's time-invariant block: set decay=fixed (or use "
                                 "init=diagonal/defective with decay=selective)")
            if self.init == "hippo" and self.state_norm == "step":
                raise ValueError("state_norm=step runs the Jordan-structured normalised scan; init=hippo is a "
                                 "dense block: use state_norm=none or readout with hippo")
            if self.state_norm in ("step", "readout") and self.block_size < 2:
                raise ValueError(f"state_norm={self.state_norm} normalises each block over its m components, "
                                 f"which maps every state to the bias when block_size=1; use block_size >= 2 "
                                 f"or state_norm=none")

    contract_options = {"block_size": 4, "n_blocks": 4, "decay": "selective", "init": "defective", "chunk_size": 8}

    def __init__(self, d_model: int, options: "Jordan.Options"):
        super().__init__(d_model, options)
        o = options
        m = o.block_size
        if o.n_blocks is None and d_model < m:
            raise ValueError(f"jordan: block_size {m} exceeds d_model {d_model}; set n_blocks explicitly")
        self.m = m
        self.N = o.n_blocks if o.n_blocks is not None else d_model // m
        self.in_proj = nn.Linear(d_model, self.N * m, bias=False)   # B
        self.out_proj = nn.Linear(self.N * m, d_model, bias=False)  # C
        if o.decay == "selective":
            self.gate = DecayGate(d_model, self.N)
        if o.init == "hippo":
            A = hippo_legs_block(m, o.rho).float().expand(self.N, m, m).clone()
            self._param_or_buffer("transition", A, o.learn_transition)
        else:
            c = torch.full((self.N,), 1.0 if o.init == "defective" else 0.0)
            self._param_or_buffer("coupling", c, o.learn_transition)
        if o.state_norm != "none":
            self.norm_weight = nn.Parameter(torch.ones(self.N, m))
            self.norm_bias = nn.Parameter(torch.zeros(self.N, m))
            no_weight_decay(self, "norm_weight", "norm_bias")  # LayerNorm gain and bias, one per block

    def _param_or_buffer(self, name, value, learn):
        if learn:
            setattr(self, name, nn.Parameter(value))
        else:
            self.register_buffer(name, value)
        # the coupling c and the dense HiPPO block are the transition under study: decay would pull them
        # towards c = 0 (diagonal) or A = 0 (no memory), i.e. towards another model, not a smaller one
        no_weight_decay(self, name)

    # --- pieces ---------------------------------------------------------------------------------
    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """``lam (..., N)`` for inputs ``x (..., d_model)``, fp32 (fp64 stays)."""
        if self.options.decay == "selective":
            g, _ = self.gate(x)
            return torch.exp(g)
        return torch.full((*x.shape[:-1], self.N), self.options.rho, dtype=at_least_fp32(x).dtype, device=x.device)

    def transition_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """The materialised ``A_t (..., N, m, m)`` for inputs ``x (..., d_model)`` (for checks)."""
        lam = self.decay(x)
        if self.options.init == "hippo":
            return self.transition.to(lam.dtype).expand(*lam.shape, self.m, self.m)
        return jordan_transition(lam, self.coupling.to(lam.dtype), self.m)

    def _layer_norm(self, h):
        w, b = self.norm_weight.to(h.dtype), self.norm_bias.to(h.dtype)
        return F.layer_norm(h, (self.m,), eps=self.options.norm_eps) * w + b

    def _readout(self, h, dtype):
        if self.options.state_norm == "readout":
            h = self._layer_norm(h)
        if _projects_in_fp32(self.out_proj.weight):
            with torch.autocast(h.device.type, enabled=False):  # y in fp16, as out_proj would give it
                return F.linear(h.flatten(-2), self.out_proj.weight.to(h.dtype)).to(torch.float16)
        return self.out_proj(h.flatten(-2).to(dtype))

    # --- contract -------------------------------------------------------------------------------
    def _inputs(self, x):
        """``(lam, b)``: the decay and the scan's input. On the GPU plan with a selective decay the gate's and the
        input's projections are one matmul (x's only reader). In an fp16 model both compute in fp32 (see
        :func:`_projects_in_fp32`)."""
        if _projects_in_fp32(self.in_proj.weight):
            x = x.to(torch.float16).float()  # x rounded as autocast would round it (input_to_linear): a no-op in fp16
            with torch.autocast(x.device.type, enabled=False):
                b = F.linear(x, self.in_proj.weight.float())
                if self.options.decay == "selective":
                    lam = torch.exp(self.gate.log_decay(F.linear(x, self.gate.proj.weight.float())))
                else:
                    lam = self.decay(x)
        elif self.options.decay == "selective" and one_pass(x):
            raw, b = project(x, [self.gate.proj, self.in_proj])
            lam = torch.exp(self.gate.log_decay(raw))
        else:
            lam, b = self.decay(x), self.in_proj(x)
        return lam, at_least_fp32(b).unflatten(-1, (self.N, self.m))

    def prefill(self, x, mask=None):
        o = self.options
        lam, b = self._inputs(x)
        chunk = chunk_size_for(b, "blockscan", o.chunk_size)
        if o.init == "hippo":
            A = self.transition.to(b.dtype).expand(*b.shape[:2], self.N, self.m, self.m)
            h, h_last = block_scan(A, b, chunk_size=chunk, backend=o.backend)
        elif o.state_norm == "step":
            h, h_last = jordan_scan_normed(lam, self.coupling.to(b.dtype), b, self.norm_weight.to(b.dtype),
                                           self.norm_bias.to(b.dtype), eps=o.norm_eps, backend=o.backend)
        else:
            h, h_last = jordan_scan(lam, self.coupling.to(b.dtype), b, chunk_size=chunk, backend=o.backend)
        # the state in the module's compute dtype, as init_state and step hold it (fp32 in a 16-bit model: every
        # step adds to it); under autocast x may come in the autocast dtype (input_to_linear)
        return self._readout(h, x.dtype), {"h": h_last.to(compute_dtype(self.out_proj.weight.dtype))}

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        return {"h": torch.zeros(batch_size, self.N, self.m, device=device, dtype=compute_dtype(dtype))}

    def step(self, x_t, state):
        o = self.options
        lam, b = self._inputs(x_t)
        if o.init == "hippo":
            A = self.transition.to(b.dtype).expand(b.shape[0], self.N, self.m, self.m)
            h = block_scan_step(A, b, state["h"])
        elif o.state_norm == "step":
            h = jordan_step_normed(lam, self.coupling.to(b.dtype), b, self.norm_weight.to(b.dtype),
                                   self.norm_bias.to(b.dtype), state["h"], eps=o.norm_eps)
        else:
            h = jordan_step(lam, self.coupling.to(b.dtype), b, state["h"])
        return self._readout(h, x_t.dtype), {"h": h.to(compute_dtype(self.out_proj.weight.dtype))}

    def state_size(self, seq_len: int) -> int:
        return self.N * self.m
