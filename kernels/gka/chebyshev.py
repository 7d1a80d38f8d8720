"""Iterative solvers for the GKA ridge systems ``A x = q`` with ``A = H + lambda I`` (symmetric PD),
and their backward passes.

The solvers never see ``A`` itself: they take an *operator* (an :class:`Operator`: ``matvec``, ``vjp``,
and optionally its own blocking and Chebyshev loop) and the operator's tensor parameters. Two operators
exist:

- :data:`DenseOp` — ``A = H + lam I`` with an explicit ``H`` per system (the reference path and the
  decode step);
- :class:`ChunkOp` — GKA's within-chunk operator (Gated KalmaNet, Sec. 4.2): every token ``t``
  of a chunk solves with ``A_t = e^{G_t} H_0 + sum_{s<=t} e^{G_t-G_s} k_s k_s^T + lam_t I`` through the
  matvec ``e^{G_t} H_0 xi_t + ((xi K^T) * causal decay mask) K + lam_t xi_t``, never forming a
  per-token ``d x d`` matrix. The chunked path hands it the mask's log ``S`` summed per segment
  (:func:`kernels.common.segment_log_decays`) and takes the mask's gradient back as ``dS``: as
  ``G_t - G_s``, the gradient of a saturated gate (``g = -50``) was the difference of O(1) sums, rounding
  noise (relative error 0.2..1 in fp64 as in fp32).

``operator.vjp(params, xi, u)`` returns the gradient of ``<u, A(params) xi>`` with respect to the
parameters. Because ``dA = -z x^T`` (implicit function theorem) and every Chebyshev step contributes
``-c_i dxi_i xi_{i-1}^T`` to ``dA``, both backward passes below reduce to calls of ``vjp``.

Chebyshev iteration (Algorithm 1 of "Gated KalmaNet", arXiv:2511.21016), spectrum of ``A`` inside ``[mu, L]``::

    rho = (L - mu) / (L + mu),  s = 2 / (L + mu)
    xi_{-1} = 0,  xi_0 = s q,  omega_0 = 2
    omega_i = 4 / (4 - rho^2 omega_{i-1})
    xi_i = xi_{i-1} - s omega_i (A xi_{i-1} - q) + (omega_i - 1)(xi_{i-1} - xi_{i-2}),   i = 1..r

The residual after ``r`` iterations is a degree ``r + 1`` scaled Chebyshev polynomial of ``A`` applied
to ``q``, so ``||A xi_r - q|| / ||q|| <= 2 rho_c^{r+1}`` with ``rho_c = (sqrt(kappa)-1)/(sqrt(kappa)+1)``,
``kappa = L / mu``. No inner products appear, which is why it is stable in low precision.

Gradient modes (``grad=``):

- ``"autograd"``: backpropagate through the unrolled iterations (stores every iterate);
- ``"implicit"``: treat the output as the exact solution: ``dq = A^{-1} dx`` by another solve of the
  same kind (``A`` is symmetric), ``dA = -dq x^T``. For Chebyshev, ``dq`` is *exactly* the unrolled
  gradient (the iteration is a symmetric polynomial ``p_r(A)``, the paper's Lemma 2); ``dA`` is exact only
  at convergence.
- ``"reverse_chebyshev"``: the paper's exact backward (Appendix E.1, Algorithm 2): the iteration is run
  backwards from the last two iterates, recomputing ``xi_{i-2} = (omega_i xi_{i-1} - s omega_i A
  xi_{i-1} + s omega_i q - xi_i) / (omega_i - 1)`` while propagating ``dxi``; nothing but ``xi_r`` and
  ``xi_{r-1}`` is stored. Equal to ``"autograd"`` in exact arithmetic; in floating point each reversed step
  amplifies the reconstruction's rounding by about ``1 / rho_c`` while the adjoint that weights it shrinks by
  as much, so the error stays near rounding times ``rho_c^{-r}`` (fp32 against fp64 autograd: 1e-4 per system
  at ``kappa`` 51 and ``r`` 30; 1e-3..5e-2 through a whole GKA layer, where systems' gradients cancel, against
  1e-5..8e-3 for fp32 ``"autograd"``; 1e-11 in fp64). A row stops reconstructing once its adjoint has fallen
  to rounding of its peak (:func:`reverse_settled`): a well-conditioned system (small ``rho``, e.g. ``H_t ~ 0``
  under the ridge floor) otherwise overflowed fp32 and turned every gradient into NaN.

Conventions and deviations (documented on purpose):

- The spectrum bounds ``mu, L`` only set the step sizes; they are treated as constants of the
  solver (no gradient flows through them in any mode). ``A`` itself, including ``lambda = a
  ||H||_F``, is differentiated.
- The paper's Eq. (49)/(50) print ``+ c_i q`` in the reversed step; solving Eq. (44) for
  ``xi_{i-2}`` gives ``- c_i q`` (with ``b_i = -(omega_i - 1)``), which is what is implemented.
- The paper reverses the weight schedule too (``nu_{i-1} = 4/rho^2 (1 - 1/nu_i)``, Eq. 47). That
  recursion is repelled from the fixed point ``omega_1*`` the forward schedule converges to, so its
  rounding error grows like ``R^{-i}``; we recompute the (scalar per system) forward schedule instead.
  :func:`omega_schedule_reversed` implements Eq. (47) for comparison.
- ``"cg"`` is textbook conjugate gradients from ``x_0 = 0`` (as MesaNet's chunked CG), with a
  breakdown guard (a zero denominator gives a zero step, not NaN); a system stops once its residual is
  below the dtype's rounding (``eps ||q||``), so that unrolled gradients stay finite.
"""
from __future__ import annotations

import abc

import torch

from ..common import causal_decay_mask
from ..device import plan_for

SOLVERS = ("chebyshev", "cg")
GRAD_MODES = ("implicit", "reverse_chebyshev", "autograd")

# below this (omega_i - 1) the momentum weight vanishes (rho ~ 0, A ~ mu I: every iterate equals the
# solution) and the reversed step cannot divide by it; the previous iterate is reused instead
_REVERSE_MIN_MOMENTUM = 1e-6


def reverse_settled(settled, g, g_peak, eps: float):
    """Rows whose adjoint has fallen to ``eps`` of its peak: from there on the reversed iteration stops
    reconstructing (sticky). The reconstruction error grows by ``~1/rho_c`` per reversed step as fast as the
    adjoint ``dxi_i`` shrinks, so its product with the adjoint stays at rounding level, but it overflows fp32
    within ``r`` steps when ``rho`` is small (a well-conditioned system: ``inf * 0`` then made every
    gradient NaN). Steps below ``eps`` of the peak adjoint add less than rounding, whatever iterate they use.
    Returns ``(settled, g_peak)`` updated with ``g``'s row magnitudes."""
    mag = g.abs().amax(-1)
    g_peak = torch.maximum(g_peak, mag)
    return settled | (mag <= eps * g_peak), g_peak


# --------------------------------------------------------------------------------------------------
# operators
# --------------------------------------------------------------------------------------------------
class Operator(abc.ABC):
    """What the solvers use of ``A(params)``, and nothing else: the two required methods and two with
    defaults that an operator overrides when it can do better."""

    @abc.abstractmethod
    def matvec(self, params, xi):
        """``A(params) xi`` for a batch of vectors ``xi``."""

    @abc.abstractmethod
    def vjp(self, params, xi, u):
        """The gradients of ``<u, A(params) xi>`` with respect to each tensor of ``params``."""

    def blocks(self, params, q, mu, L):
        """None to solve every system at once (the default), or a list of independent blocks
        ``(op, params, q, mu, L, rows)`` whose tensors are flattened to ``(systems, ...)``."""
        return None

    def chebyshev(self, params, q, mu, L, r: int, return_prev: bool = False):
        """:func:`chebyshev_iterate` with this operator, no autograd (an operator may fuse the loop)."""
        return chebyshev_iterate(lambda v: self.matvec(params, v), q, mu, L, r, return_prev=return_prev)


class DenseOperator(Operator):
    """``A = H + lam I``. ``H (..., d, d)``, ``lam (...)``, vectors ``(..., d)`` (column convention)."""

    @staticmethod
    def matvec(params, xi):
        H, lam = params
        return torch.einsum("...ij,...j->...i", H, xi) + lam.unsqueeze(-1) * xi

    @staticmethod
    def vjp(params, xi, u):
        # <u, H xi + lam xi>:  dH = u xi^T,  dlam = u . xi
        return torch.einsum("...i,...j->...ij", u, xi), (u * xi).sum(-1)


#: the dense operator holds no state, so one instance serves every solve
DenseOp = DenseOperator()


def decay_mask(G: torch.Tensor) -> torch.Tensor:
    """``M[..., t, s] = exp(G_t - G_s)`` for ``s <= t`` else 0, from ``G (b, h, n, C)``: for a caller that holds
    only the cumulative sums (a caller with the per-step decays takes ``segment_log_decays(g).exp()``)."""
    return causal_decay_mask(G, dim=-1)


class ChunkOp(Operator):
    """GKA's within-chunk operator. Parameters ``(H0, K, G, lam)`` or ``(H0, K, G, lam, S)``, heads-first layout:

    ``H0 (b, h, n, d, d)`` chunk-start state, ``K (b, h, n, C, d)`` keys, ``G (b, h, n, C)`` inclusive
    cumulative log decay from the chunk start, ``lam (b, h, n, C)`` ridge, ``S (b, h, n, C, C)`` the log of the
    mask (:func:`kernels.common.segment_log_decays`). Vectors ``(b, h, n, C, d)``.
    ``(A_t xi_t) = e^{G_t} H0 xi_t + sum_{s<=t} e^{G_t-G_s} (k_s . xi_t) k_s + lam_t xi_t``: per chunk,
    ``((Xi K^T) * M) K + diag(e^G) Xi H0^T + diag(lam) Xi`` (batched matmuls).

    One instance per solve: it holds the causal decay mask ``M`` of that solve (``e^S``, computed once), which
    every one of the ~2 r matvecs of the solve reuses. With ``S`` among the parameters, :meth:`vjp` hands back
    the mask's gradient as ``dS = dM * M`` (autograd through ``S`` takes it to each step's decay from the
    segments that hold it) and ``dG`` is that of ``e^{G_t}`` alone; without ``S``, ``dG`` includes the mask's
    dependence on ``G`` as ``G_t - G_s``. With ``grad="autograd"`` (unrolled) the mask must carry its graph
    (``ChunkOp(decay_mask(G))``, or ``ChunkOp(S.exp())``). ``decay`` (``e^G`` unsqueezed) is likewise computed
    once per solve, and ``kh`` (``[K^T | H0^T]``, given, or built at the first :meth:`matvec` when ``fuse``) once
    per operator: the rearranged Chebyshev loop (:meth:`chebyshev`) and :meth:`vjp` never read it.
    :meth:`for_params` builds a detached operator.
    """

    def __init__(self, mask: torch.Tensor, decay: torch.Tensor | None = None, kh: torch.Tensor | None = None,
                 fuse: bool = False):
        self.mask = mask
        self.decay = decay  # e^{G} (b, h, n, C, 1), or None to compute it from G at every use
        self.kh = kh        # [K^T | H0^T] (b, h, n, d, C + d): one matmul gives Xi K^T and Xi H0^T
        self.fuse = fuse    # build kh from the parameters at the first matvec

    #: elements of one (C, max(C, d)) operand of a block of systems: every operand of a block's matvec
    #: then stays in a core's L2 cache for the whole iteration (about 3x faster than streaming all
    #: chunks through memory once per pass on a CPU). The CPU plan only: on a GPU each block would be
    #: ~7 r more kernel launches, so the GPU plan solves every system at once.
    BLOCK_ELEMENTS = 1 << 17

    def blocks(self, params, q, mu, L):
        """Split the solve over chunks into cache-sized blocks of independent systems (CPU plan only).

        Returns None when one block holds everything or on the GPU plan (:func:`kernels.device.plan_for`),
        else a list of ``(op, params, q, mu, L, rows)`` with every tensor flattened to ``(b*h*n, ...)`` and
        ``rows`` the block's slice of that axis.
        """
        H0, K, G, lam = params[:4]                       # a forward solve: S is only read by vjp
        if plan_for(K).one_pass:
            return None
        C, d = K.shape[-2], K.shape[-1]
        lead = K.shape[:-2]
        n_sys = lead.numel()
        size = max(1, self.BLOCK_ELEMENTS // (C * max(C, d)))
        if n_sys <= size + size // 2:
            return None
        flat = lambda t: None if t is None else t.reshape(n_sys, *t.shape[len(lead):])  # noqa: E731
        H0f, Kf, Gf, lamf, qf, muf, Lf = (flat(t) for t in (H0, K, G, lam, q, mu, L))
        maskf, decayf, khf = flat(self.mask), flat(self.decay), flat(self.kh)
        out = []
        for i in range(0, n_sys, size):
            r = slice(i, min(i + size, n_sys))
            op = ChunkOp(maskf[r], None if decayf is None else decayf[r], None if khf is None else khf[r], self.fuse)
            out.append((op, (H0f[r], Kf[r], Gf[r], lamf[r]), qf[r], muf[r], Lf[r], r))
        return out

    def chebyshev(self, params, q, mu, L, r: int, return_prev: bool = False):
        """:func:`chebyshev_iterate` with this operator (no autograd), rearranged for fewer passes.

        With ``d_i = xi_i - xi_{i-1}`` the step ``xi_{i+1} = xi_i + c_i (q - A xi_i) + (omega_i - 1) d_i``
        (``c_i = s omega_i``) becomes ``d_{i+1} = (omega_i - 1) d_i + c_i res_i``, ``xi_{i+1} = xi_i + d_{i+1}``
        with the residual ``res_i = q - lam xi_i - e^G (xi_i H0^T) - ((xi_i K^T) * M) K`` built in place
        (the last term by one ``baddbmm``). Same iteration as :func:`chebyshev_iterate` up to rounding.
        """
        H0, K, G, lam = params[:4]
        s = (2.0 / (L + mu)).unsqueeze(-1)
        rho = (L - mu) / (L + mu)
        neg_decay = -self._decay(G)
        neg_lam = -lam.unsqueeze(-1)
        lead = K.shape[:-2]
        C = K.shape[-2]
        flat = lambda t: t.reshape(lead.numel(), *t.shape[len(lead):])  # noqa: E731  (bmm needs 3-d)
        Kf, Mf = flat(K), flat(self.mask)
        Ktf, H0tf = flat(K.transpose(-1, -2)).contiguous(), flat(H0.transpose(-1, -2)).contiguous()
        xi = flat(s * q)
        d = xi.clone()                                                     # xi_0 - xi_{-1}
        qf, neg_decay, neg_lam = flat(q), flat(neg_decay), flat(neg_lam)
        weights = [flat(om.unsqueeze(-1)) for om in omega_schedule(rho, r)]
        if weights:  # the step weights of every iteration at once, (r, systems, C, 1): omega_i - 1, s omega_i
            omegas = torch.stack(weights)
            momentum, step = omegas - 1.0, flat(s) * omegas
        P = xi.new_empty(xi.shape[0], C, C)
        res = torch.empty_like(xi)
        for i in range(r):
            # two bmm calls, not one on [K^T | H0^T]: the BLAS blocks a wider product differently, so its
            # columns would not be bit-identical to these
            torch.bmm(xi, H0tf, out=res)
            torch.addcmul(qf, neg_decay, res, out=res)
            res.addcmul_(neg_lam, xi)
            torch.bmm(xi, Ktf, out=P).mul_(Mf)
            res.baddbmm_(P, Kf, alpha=-1.0)
            d.mul_(momentum[i]).addcmul_(step[i], res)
            xi.add_(d)
        xi = xi.view(q.shape)
        return (xi, xi - d.view(q.shape)) if return_prev else xi

    @classmethod
    def for_params(cls, params) -> "ChunkOp":
        with torch.no_grad():
            return cls(decay_mask(params[2]), params[2].exp().unsqueeze(-1))

    def _decay(self, G):
        return G.exp().unsqueeze(-1) if self.decay is None else self.decay

    def matvec(self, params, xi):
        H0, K, G, lam = params[:4]
        if self.kh is None and self.fuse:
            self.kh = torch.cat([K.transpose(-1, -2), H0.transpose(-1, -2)], dim=-1)
        if self.kh is None:
            xk, xh = xi @ K.transpose(-1, -2), xi @ H0.transpose(-1, -2)
        else:
            xkh = xi @ self.kh
            C = K.shape[-2]
            xk, xh = xkh[..., :C], xkh[..., C:]
        y = torch.addcmul((xk * self.mask) @ K, self._decay(G), xh)
        return torch.addcmul(y, lam.unsqueeze(-1), xi)

    def vjp(self, params, xi, u):
        H0, K, G, lam, *S = params
        M = self.mask
        eG = self._decay(G).squeeze(-1)
        Kt = K.transpose(-1, -2)
        dH0 = (eG.unsqueeze(-1) * u).transpose(-1, -2) @ xi                   # sum_t e^{G_t} u_t xi_t^T
        dG = eG * (u * (xi @ H0.transpose(-1, -2))).sum(-1)
        xk = xi @ Kt                                                          # (xi_t . k_s)
        uk = u @ Kt                                                           # (u_t . k_s)
        A = xk * M
        B = uk * M
        W = A * uk                                     # M_ts (xi_t.k_s)(u_t.k_s): the gradient of log M_ts
        dK = B.transpose(-1, -2) @ xi + A.transpose(-1, -2) @ u
        dlam = (u * xi).sum(-1)
        if S:
            return dH0, dK, dG, dlam, W
        return dH0, dK, dG + W.sum(-1) - W.sum(-2), dlam


# --------------------------------------------------------------------------------------------------
# solvers (forward)
# --------------------------------------------------------------------------------------------------
def omega_schedule(rho: torch.Tensor, r: int) -> list[torch.Tensor]:
    """``[omega_1, ..., omega_r]`` with ``omega_0 = 2``, ``omega_i = 4 / (4 - rho^2 omega_{i-1})``."""
    rho2 = rho * rho
    om = torch.full_like(rho, 2.0)
    out = []
    for _ in range(r):
        om = 4.0 / (4.0 - rho2 * om)
        out.append(om)
    return out


def omega_schedule_reversed(rho: torch.Tensor, omega_r: torch.Tensor, r: int) -> list[torch.Tensor]:
    """The paper's Eq. (47): ``nu_r = omega_r``, ``nu_{i-1} = 4/rho^2 (1 - 1/nu_i)``; returns
    ``[nu_1, ..., nu_r]`` (for comparison with :func:`omega_schedule`; not used by the solvers)."""
    nus = [omega_r]
    nu = omega_r
    for _ in range(r - 1):
        nu = 4.0 / (rho * rho) * (1.0 - 1.0 / nu)
        nus.append(nu)
    return nus[::-1]


def chebyshev_iterate(matvec, q, mu, L, r: int, return_prev: bool = False):
    """``r`` Chebyshev iterations for ``A xi = q`` (``r >= 0``; ``r = 0`` returns ``xi_0 = s q``).

    ``mu, L``: spectrum bounds broadcastable against ``q[..., 0]``. Returns ``xi_r`` (and
    ``xi_{r-1}``, zero for ``r = 0``, when ``return_prev``).
    """
    s = (2.0 / (L + mu)).unsqueeze(-1)
    rho = (L - mu) / (L + mu)
    xi_prev = torch.zeros_like(q)
    xi = s * q
    for om in omega_schedule(rho, r):
        om = om.unsqueeze(-1)
        # xi - s om (A xi - q) + (om - 1)(xi - xi_prev), in three fused passes
        xi_new = torch.addcmul(torch.addcmul(xi, s * om, q - matvec(xi)), om - 1.0, xi - xi_prev)
        xi_prev, xi = xi, xi_new
    return (xi, xi_prev) if return_prev else xi


def cg_iterate(matvec, q, r: int):
    """``r`` conjugate-gradient iterations from ``x_0 = 0`` (breakdown-guarded: 0/0 steps are 0).

    A system stops once its squared residual is at most ``eps^2 ||q||^2`` (``eps`` of ``q``'s dtype): its
    later steps would only fit rounding, and backpropagating through them (``grad="autograd"``) divides by
    squares of residuals that underflow, which turned gradients into NaN in fp32.
    """
    x = torch.zeros_like(q)
    res = q.clone()
    p = res.clone()
    delta = (res * res).sum(-1, keepdim=True)
    converged = delta.detach() * torch.finfo(q.dtype).eps ** 2
    for _ in range(r):
        live = delta > converged
        Ap = matvec(p)
        den = (p * Ap).sum(-1, keepdim=True)
        ok = live & (den > 0)
        a = torch.where(ok, delta / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(den))
        x = x + a * p
        res = res - a * Ap
        delta_new = (res * res).sum(-1, keepdim=True)
        beta = torch.where(live, delta_new / torch.where(live, delta, torch.ones_like(delta)), torch.zeros_like(delta))
        p = res + beta * p
        delta = delta_new
    return x


def _run_op(solver, op: Operator, params, q, mu, L, r, return_prev: bool = False):
    """``_run`` with the operator ``op``, block by block when it splits the systems into blocks
    (:class:`ChunkOp`: independent systems, identical arithmetic); ``return_prev`` with Chebyshev only.
    Not for autograd through the iterations."""
    blocks = op.blocks(params, q, mu, L)
    if blocks is None:
        if solver == "chebyshev":
            return op.chebyshev(params, q, mu, L, r, return_prev=return_prev)
        return _run(solver, lambda v: op.matvec(params, v), q, mu, L, r)
    n_sys = blocks[-1][-1].stop
    x = q.new_empty(n_sys, *q.shape[-2:])
    x_prev = q.new_empty(n_sys, *q.shape[-2:]) if return_prev else None
    for op_b, params_b, q_b, mu_b, L_b, rows in blocks:
        if solver == "chebyshev":
            out = op_b.chebyshev(params_b, q_b, mu_b, L_b, r, return_prev=return_prev)
            if return_prev:
                x[rows], x_prev[rows] = out
            else:
                x[rows] = out
        else:
            x[rows] = _run(solver, lambda v: op_b.matvec(params_b, v), q_b, mu_b, L_b, r)
    x = x.view(q.shape)
    return (x, x_prev.view(q.shape)) if return_prev else x


def _run(solver, matvec, q, mu, L, r):
    if solver == "chebyshev":
        return chebyshev_iterate(matvec, q, mu, L, r)
    if solver == "cg":
        return cg_iterate(matvec, q, r)
    raise ValueError(f"unknown solver {solver!r}; choose one of {SOLVERS}")


# --------------------------------------------------------------------------------------------------
# backward passes
# --------------------------------------------------------------------------------------------------
def _add(acc, new):
    return list(new) if acc is None else [a + b for a, b in zip(acc, new)]


def reverse_chebyshev_backward(op, params, q, mu, L, r, xi_r, xi_rm1, dxi_r):
    """The paper's Algorithm 2 (with the sign of ``c_i q`` corrected): exact ``(dq, dparams)`` of
    ``xi_r = chebyshev_iterate(op.matvec, q, mu, L, r)`` from the last two iterates only."""
    matvec = lambda v: op.matvec(params, v)  # noqa: E731
    s = (2.0 / (L + mu)).unsqueeze(-1)
    rho = (L - mu) / (L + mu)
    omegas = [om.unsqueeze(-1) for om in omega_schedule(rho, r)]
    g_cur, g_next = dxi_r, torch.zeros_like(dxi_r)  # total grads of xi_i and xi_{i+1}
    xi_cur, xi_prev = xi_r, xi_rm1  # xi_i, xi_{i-1}
    om_next = None
    dq = torch.zeros_like(q)
    dparams = None
    settled = torch.zeros(q.shape[:-1], dtype=torch.bool, device=q.device)
    g_peak = dxi_r.abs().amax(-1)
    eps = torch.finfo(q.dtype).eps
    for i in range(r, 0, -1):
        om = omegas[i - 1]
        c = s * om
        dq = dq + c * g_cur
        dparams = _add(dparams, op.vjp(params, xi_prev, -c * g_cur))
        g_prev = om * g_cur - c * matvec(g_cur)
        if om_next is not None:
            g_prev = g_prev - (om_next - 1.0) * g_next
        if i >= 2:
            m = om - 1.0
            settled, g_peak = reverse_settled(settled, g_prev, g_peak, eps)  # xi_{i-2} meets dxi_{i-1}
            ok = (m > _REVERSE_MIN_MOMENTUM) & ~settled.unsqueeze(-1)
            recon = (om * xi_prev - c * matvec(xi_prev) + c * q - xi_cur) / torch.where(ok, m, torch.ones_like(m))
            xi_pp = torch.where(ok, recon, xi_prev)
        else:
            xi_pp = torch.zeros_like(xi_prev)
        g_next, g_cur = g_cur, g_prev
        xi_cur, xi_prev = xi_prev, xi_pp
        om_next = om
    dq = dq + s * g_cur  # xi_0 = s q
    if dparams is None:
        dparams = [torch.zeros_like(p) for p in params]
    return dq, dparams


class _IterativeSolve(torch.autograd.Function):
    """``x = solver(A(params)) q`` with an implicit or reverse-Chebyshev backward."""

    @staticmethod
    def forward(ctx, op, solver, grad, r, q, mu, L, *params):
        if solver == "chebyshev":
            x, x_prev = _run_op(solver, op, params, q, mu, L, r, return_prev=True)
        else:
            x, x_prev = _run_op(solver, op, params, q, mu, L, r), None
        ctx.op, ctx.solver, ctx.grad, ctx.r = op, solver, grad, r
        if grad == "reverse_chebyshev":
            ctx.save_for_backward(q, mu, L, x, x_prev, *params)
        else:
            ctx.save_for_backward(q, mu, L, x, *params)
        return x

    @staticmethod
    def backward(ctx, dx):
        op, r = ctx.op, ctx.r
        if ctx.grad == "reverse_chebyshev":
            q, mu, L, x, x_prev, *params = ctx.saved_tensors
            dq, dparams = reverse_chebyshev_backward(op, params, q, mu, L, r, x, x_prev, dx)
        else:
            q, mu, L, x, *params = ctx.saved_tensors
            z = _run_op(ctx.solver, op, params, dx, mu, L, r)
            dq = z
            dparams = op.vjp(params, x, -z)
        return (None, None, None, None, dq, None, None, *dparams)


def iterative_solve(op: Operator, params, q, mu, L, *, num_iter: int, solver: str = "chebyshev", grad: str = "implicit"):
    """Solve ``A(params) x = q`` with ``num_iter`` iterations of ``solver``; backward per ``grad``.

    ``mu, L`` are detached (solver constants). ``num_iter = 0`` is *not* special-cased here (GKA's
    "r = 0 means no solve" convention lives in the callers); Chebyshev with ``r = 0`` returns
    ``2 q / (L + mu)``.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {SOLVERS}")
    if grad not in GRAD_MODES:
        raise ValueError(f"unknown grad mode {grad!r}; choose one of {GRAD_MODES}")
    if grad == "reverse_chebyshev" and solver != "chebyshev":
        raise ValueError("grad='reverse_chebyshev' needs solver='chebyshev' (CG cannot be reversed stably); "
                         "use grad='implicit' or 'autograd' with CG")
    mu, L = mu.detach(), L.detach()
    if grad == "autograd":
        return _run(solver, lambda v: op.matvec(params, v), q, mu, L, num_iter)
    if not (q.requires_grad or any(p.requires_grad for p in params)):
        return _run_op(solver, op, params, q, mu, L, num_iter)
    return _IterativeSolve.apply(op, solver, grad, num_iter, q, mu, L, *params)


def chebyshev_residual_bound(kappa: torch.Tensor, r: int) -> torch.Tensor:
    """``2 rho_c^{r+1} / (1 + rho_c^{2(r+1)})``: bound on ``||A xi_r - q|| / ||q||`` for ``kappa = L/mu``."""
    sk = kappa.sqrt()
    rc = (sk - 1) / (sk + 1)
    p = rc ** (r + 1)
    return 2 * p / (1 + p * p)
