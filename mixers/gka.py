"""Gated KalmaNet (GKA): test-time ridge regression solved per token by Chebyshev iteration.

Liangzu Peng et al., "Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge Regression", arXiv 2511.21016
(Fig. 4, Sec. 4, Algorithm 1 and Appendices D-E). Per head, d = head_dim:

    q, k, v = SiLU(short_conv_4(W_qkv x));  q, k <- q/||q||, k/||k||
    beta_t = sigmoid(W_b x_t + b):  k_t, v_t <- beta_t k_t, beta_t v_t     (statistics carry beta^2)
    alpha_t = sigmoid(W_alpha x_t + b)                                     (alpha-connection gate, in [0, 1])
    g_t = -exp(A_log) softplus(W_a x_t + dt_bias)                          (forgetting gate, both states)
    H_t = e^{g_t} H_{t-1} + k_t k_t^T,     U_t = e^{g_t} U_{t-1} + v_t k_t^T
    lambda_t = a ||H_t||_F + eps           (a = ridge_a = 0.02: condition number <= (1 + a)/a = 51)
    x_t ~= (H_t + lambda_t I)^{-1} q_t     (num_iter = r = 30 Chebyshev iterations, see below)
    q~_t = q_t + alpha_t (x_t - q_t),      o_t = U_t q~_t / sqrt(d)
    y = W_o [GatedRMSNorm(o_t) * silu(W_g x_t)]

At convergence ``U_t x_t = S_t q_t``, the prediction of the paper's gated ridge regression

    S_t = argmin_S lambda_t ||S||_F^2 + sum_{i<=t} eta_{t,i} ||S k_i - v_i||^2,   eta_{t,i} = prod_{j=i+1..t} e^{g_j}.

The solve is the paper's Algorithm 1 on ``A = H_t + lambda_t I`` with spectrum bounds ``mu = lambda_t``,
``L = lambda_t + ||H_t||_F`` (``||H||_2 <= ||H||_F``), for i = 1..r:

    rho = (L - mu)/(L + mu);  xi_{-1} = 0,  xi_0 = 2 q/(L + mu),  omega_0 = 2,  omega_i = 4/(4 - rho^2 omega_{i-1})
    xi_i = xi_{i-1} - (2 omega_i/(L + mu)) (A xi_{i-1} - q) + (omega_i - 1)(xi_{i-1} - xi_{i-2})

Where this departs from the paper, on purpose: ``eps = ridge_eps = 1e-6`` is added to the paper's
``lambda_t = a ||H_t||_F`` so that the system stays solvable while ``H_t = 0`` (the first tokens, zero keys;
``ridge_eps=0`` gives the paper's ridge exactly); the bounds ``mu, L`` are solver constants (no gradient flows
through them; ``lambda_t`` itself is differentiated, the paper's Eq. 13). ``num_iter = 0`` means "no solve"
(``x = q``, the paper's r = 0 ablation), not zero Chebyshev steps (which would give ``2 q/(L + mu)``): it is exactly
:mod:`mixers.gla` with the same weights. ``alpha_connection=False`` is the paper's "without alpha-connection"
ablation, ``alpha_t = 1`` (``q~ = x``). ``num_iter`` is a declared test-time knob: evaluation may run a trained
model with another iteration count (accuracy vs r without retraining).
``solver`` picks Chebyshev (the paper's), conjugate gradients (MesaNet-style, ``num_iter``
steps; its inner products make it fragile in low precision) or an exact solve (materialises every
``H_t``). ``grad`` picks the backward through the solve (implicit differentiation, the paper's exact
reverse-Chebyshev Algorithm 2, or autograd through the unrolled iterations). The core is
:func:`kernels.gka.gka`; decode is :func:`kernels.gka.gka_step`.

Non-finite inputs: a NaN or inf at position t reaches the earlier outputs of its chunk (NaN times the
zero of the chunk's causal mask); large finite inputs do not (the contract suite checks 1e30).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gka import BACKENDS, gka, gka_step

from .base import register_mixer
from .gla import GatedRegressionBlock
from .options import backend_opt, chunk_size_for, chunk_size_opt, opt


@register_mixer
class GKA(GatedRegressionBlock):
    name = "gka"
    description = "Gated KalmaNet: gated ridge regression per token, Chebyshev solve (r iterations)"
    state_formula = "n_heads * (2 head_dim^2 + 3 head_dim (conv_size - 1))  (H, U and conv buffers; constant in T)"
    has_alpha = True
    test_time_knobs = ("num_iter",)

    @dataclass
    class Options:
        n_heads: int = opt(4, "number of heads", at_least=1)
        head_dim: int | None = opt(None, "key/value dimension per head (None: d_model // n_heads)", at_least=1)
        ridge_a: float = opt(0.02, "adaptive ridge lambda_t = ridge_a * ||H_t||_F + ridge_eps", at_least=0.0)
        ridge_eps: float = opt(1e-6, "absolute ridge floor (keeps the system solvable when H_t = 0)", at_least=0.0)
        num_iter: int = opt(30, "solver iterations (0 = no solve: gated linear attention); a test-time knob: "
                                "evaluation may use another count without retraining", at_least=0)
        alpha_connection: bool = opt(True, "q~ = q + alpha (x - q) with a sigmoid gate (off: q~ = x)")
        beta_gate: bool = opt(True, "sigmoid gate beta_t scaling k_t and v_t")
        forget_gate: bool = opt(True, "Mamba-2 style log-decay gate g_t shared by H and U (off: g = 0)")
        conv_size: int = opt(4, "causal short-convolution width on q, k, v", at_least=1)
        chunk_size: int | None = chunk_size_opt("gka", "chunk length of the chunked form")
        solver: str = opt("chebyshev", "linear solver: chebyshev (paper), cg (conjugate gradients, "
                                       "MesaNet-style) or exact (torch.linalg.solve on materialised H_t)",
                          choices=("chebyshev", "cg", "exact"))
        grad: str = opt("implicit", "backward through the solve: implicit differentiation, the paper's exact "
                                    "reverse Chebyshev (Algorithm 2), or autograd through the iterations",
                        choices=("implicit", "reverse_chebyshev", "autograd"))
        backend: str = backend_opt(BACKENDS, "kernel backend (triton: Chebyshev solver only)")

        def __post_init__(self):
            if self.ridge_a == 0 and self.ridge_eps == 0:
                raise ValueError("the ridge must make H + lambda I positive definite: ridge_a and ridge_eps "
                                 "cannot both be 0 (default ridge_a=0.02, ridge_eps=1e-6)")
            if self.grad == "reverse_chebyshev" and self.solver != "chebyshev":
                raise ValueError(f"grad='reverse_chebyshev' reverses the Chebyshev iteration; with solver="
                                 f"{self.solver!r} use grad='implicit' or grad='autograd'")
            if self.backend == "triton" and self.solver != "chebyshev":
                raise ValueError(f"backend='triton' implements solver='chebyshev' only; use backend='torch' "
                                 f"for solver={self.solver!r}")
            if self.backend == "triton" and self.grad == "autograd":
                raise ValueError("backend='triton' has no grad='autograd'; use grad='implicit' or "
                                 "'reverse_chebyshev', or backend='torch'")
            if self.backend == "triton" and self.chunk_size is not None and (
                    self.chunk_size < 16 or self.chunk_size & (self.chunk_size - 1)):
                raise ValueError(f"backend='triton' needs chunk_size a power of two >= 16, got {self.chunk_size}")

    contract_options = {"n_heads": 2, "head_dim": 8, "chunk_size": 8}
    # The chunked and the per-token Chebyshev solves round differently in fp32 (noise ~1e-7 * kappa with
    # kappa <= (1+a)/a ~ 51), and the per-head RMSNorm amplifies it on tokens whose output is 30-50x
    # smaller than the median: 1e-6..1.2e-4 relative. In fp64 both paths agree to 1e-10 (checked).
    contract_fp32_rtol = 3e-4

    def _reads_alpha(self) -> bool:
        # without a solve (num_iter = 0) q~ = q: the alpha gate is read by nothing
        return super()._reads_alpha() and self.knob("num_iter") > 0

    def _kw(self):
        o = self.options
        return dict(ridge_a=o.ridge_a, ridge_eps=o.ridge_eps, num_iter=self.knob("num_iter"), solver=o.solver,
                    grad=o.grad)

    def _core(self, q, k, v, g, alpha, initial_state):
        o, (H, U) = gka(q, k, v, g, alpha, chunk_size=chunk_size_for(q, "gka", self.options.chunk_size),
                        backend=self.options.backend,
                        initial_state=initial_state, **self._kw())
        sd = self._state_dtype(q.dtype)
        return o, {"H": H.to(sd), "U": U.to(sd)}

    def _core_init(self, batch_size, device, dtype):
        d, sd = self.head_dim, self._state_dtype(dtype)
        return {"H": torch.zeros(batch_size, self.n_heads, d, d, device=device, dtype=sd),
                "U": torch.zeros(batch_size, self.n_heads, d, d, device=device, dtype=sd)}

    def _core_step(self, q, k, v, g, alpha, state):
        o, (H, U) = gka_step(q, k, v, g, alpha, (state["H"], state["U"]), **self._kw())
        return o, {"H": H, "U": U}

    def _core_state_size(self):
        return 2 * self.n_heads * self.head_dim * self.head_dim
