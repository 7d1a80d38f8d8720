"""SKA: Spectral Koopman Attention (Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with
Spectral Koopman Operators", arXiv 2605.06997).

Own projections from the residual stream, per head h (rank r, lifted rank r', value dim P):

    q_t = phi(W_q x_t), k_t = phi(W_k x_t) in R^r' (W_q, W_k: r rows per head, orthogonal init),
    v_t = W_v x_t in R^P (xavier)
    keys and queries divided by the key scale s (seq_max or running_max, see below)
    G = sum w_t k_t k_t^T + lambda I,   M = sum w_t w_{t+1} k_{t+1} k_t^T,   C = sum w_t v_t k_t^T
    L = chol(G),  A_w = L^{-1} M L^{-T},  A = clamp(gamma_h, 1, gamma_max) A_w / max(sigma(A_w), 1)
    y_t = C L^{-T} A^p L^{-1} q_t;       out = W_o (eta * concat_h y_t)   (W_o zero-init, eta init 1.5)

Defaults: ridge lambda = 1e-3, power p = 2, chunks of 64, 6 power-iteration steps, gamma_max = 1.5, gamma_h init
1 (one learnable gain per head, where the paper names a single learned gamma). Since A_w = L^{-1} (M G^{-1}) L,
the readout equals ``c^p C G^{-1} (M G^{-1})^p q`` with ``c = clamp(gamma_h, 1, gamma_max) / max(sigma(A_w), 1)``;
it is not ``C L^{-T} (M G^{-1})^p L^{-1} q``, which puts the unwhitened operator inside whitened coordinates. With
p = 0 it is the ridge regression ``C G^{-1} q``, the prediction of ``argmin_S sum w_t ||S k_t - v_t||^2 + lambda
||S||^2``. For 0/1 weights ``||A_w|| <= 1`` (Cauchy-Schwarz on the whitened keys), so the division by
``max(sigma, 1)`` changes A only through rounding; it matters only if the statistics are built otherwise.

``phi`` is the key lift (``key_lift``, :mod:`mixers.key_lift`; the Clebsch-Gordan lift of the paper's
appendix "Clebsch-Gordan Invariant Lift"), applied alike to keys and queries after the projections, in
``forward``, ``prefill`` and ``step``; with the even-odd pairs z_i = u_{2i} + i u_{2i+1} of u = W x (rank r):

- ``none`` (default): phi(u) = u, r' = r;
- ``cg_invariant``: phi(u) = (|z_i|^2)_i, r' = r/2 (unchanged when each pair is rotated by any angle);
- ``cg``: phi(u) = (|z_i|^2)_i followed by the pairs (Re z_i^2, Im z_i^2), r' = 3r/2 (the invariant and
  the second-harmonic channel, which rotates by twice a pair's angle).

The lifts need an even ``rank``. The kernel sees only lifted features, so r' is the rank of G, M, C and of
the decode state. The key scale s is computed from the lifted keys (s = max ||phi(k_t)||), so the lifted
keys in the statistics have norm <= 1 exactly as unlifted ones do and ``ridge`` keeps its meaning. As phi
is homogeneous of degree 2 (phi(c u) = c^2 phi(u)), dividing the lifted features by s equals dividing the
projections by sqrt(s) before the lift; note ||phi(u)|| is not ||u||^2 (for ``cg_invariant`` it is
(sum_i |z_i|^4)^(1/2), between ||u||^2 / sqrt(r/2) and ||u||^2; ``cg`` doubles its square), so s is not
the square of the unlifted scale.

``w_t`` is the (batch, T) 0/1 ``mask`` given to ``forward`` (a prefix / "action" mask: only those
tokens enter the statistics; queries are read at every position); without a mask w = 1.
sigma is the top singular value from 6 detached power-iteration steps. All statistics and solves run
in fp32 (:mod:`kernels.ska`).

Modes (which statistics position t reads):

- ``chunk_causal`` (default, LM training): the tokens of the chunks strictly before t's chunk, lag-one
  pairs with both tokens there (chunk 0 reads nothing: output 0). ``chunk_size=1`` is the exact
  per-token recurrence (t reads tokens < t).
- ``prefix``: one operator from all (masked) tokens, read at every position (non-causal by design:
  the mask marks the context; queries come after it).

Normalisation: ``seq_max`` (paper): ``s = max ||k_t||`` over the weighted-in tokens of the whole
sequence (non-causal). ``running_max``: the scale of a readout is the largest weighted-in key inside
the statistics it reads (causal). With a mask this departs on purpose from the paper's pipeline, which
normalises every key by the largest key of the sequence before the masked accumulation: here tokens with
``w_t = 0`` set no scale, as they enter no statistic. Otherwise a masked-out token (a query after the prefix, a
generated token) would rescale the statistics it is not part of, and ``prefill`` + ``step`` (scale frozen at the
prefill) could not equal ``forward`` on the same tokens; without a mask both definitions coincide. Because G,
M, C are homogeneous in the keys, the state keeps the raw statistics and normalises at readout time, which makes
the recurrent and chunked forms agree.

Decoding (``step``), state ``G, M`` (r' x r'), ``C`` (P x r'), previous weighted key (r'), scale (1)
per head = ``H (2 r'^2 + P r' + r' + 1)`` floats (r' the lifted rank), independent of T:

- ``chunk_causal``: the per-token recurrence (the paper's streaming inference): read out from all
  tokens before this one, then add this one (decoded tokens have w = 1). Equals ``forward`` exactly
  when ``chunk_size == 1`` (the contract configuration); with larger chunks decoding is finer-grained
  than training (generated tokens see everything before them, not only whole chunks). ``running_max``
  keeps updating the scale; ``seq_max`` freezes it at the prefill value (a decode from an empty
  state takes it from the first nonzero key).
- ``prefix``: generated tokens are outside the prefix (w = 0): the operator and the scale stay
  frozen at the prefill, each step only reads out. ``prefill(x[:, :T0], m)`` then ``step`` equals
  ``forward(x, mask=[m, 0, ..., 0])``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.ska import BACKENDS, ska, ska_final_state, ska_init_state, ska_step

from .base import Mixer, State, register_mixer
from .key_lift import KEY_LIFTS, key_lift, lifted_dim
from .layers import compute_dtype, keep_autocast_dtype, no_weight_decay, project
from .options import backend_opt, opt


@register_mixer
class SKA(Mixer):
    name = "ska"
    description = "Spectral Koopman Attention: closed-form ridge readout + whitened lag-one power filter"
    state_formula = "n_heads * (2 r^2 + value_dim r + r + 1), r = lifted rank (see key_lift)  (constant in T)"
    input_to_linear = True     # x enters through the q, k, v projection only
    uses_mask = True
    test_time_knobs = ("power",)
    #: chunk_size is part of the semantics (which statistics a query reads), not only a compute knob
    chunk_size_changes_output = True
    # strictly causal, and step == forward (chunk_size 1). ridge 0.1: with the default 1e-3, positions whose
    # Gram is barely above lambda I (about r tokens seen) amplify fp32 rounding ~1/lambda, and the parallel
    # and recurrent forms then differ by ~2-4e-5 relative instead of < 1e-6
    contract_options = {"n_heads": 2, "rank": 4, "chunk_size": 1, "mode": "chunk_causal",
                        "normalisation": "running_max", "ridge": 0.1}

    @dataclass
    class Options:
        n_heads: int = opt(4, "number of heads H", at_least=1)
        rank: int = opt(32, "key/query rank r (Koopman rank) per head", at_least=1)
        value_dim: int = opt(0, "value dim P per head; 0 = d_model // n_heads", at_least=0)
        ridge: float = opt(1e-3, "ridge lambda added to the Gram matrix (keeps it invertible)", above=0.0)
        power: int = opt(2, "power-filter order p (0 = plain ridge regression readout)", at_least=0)
        chunk_size: int = opt(64, "chunk length in chunk_causal mode (1 = exact per-token recurrence)", at_least=1)
        mode: str = opt("chunk_causal", "which statistics a position reads",
                        choices=("chunk_causal", "prefix"))
        normalisation: str = opt("seq_max", "key scale: seq_max (paper, non-causal) or running_max (causal)",
                                 choices=("seq_max", "running_max"))
        gamma_max: float = opt(1.5, "upper clamp of the learnable spectral gain gamma (lower clamp 1)", at_least=1.0)
        power_iters: int = opt(6, "power-iteration steps for the spectral normalisation (the whitened operator's "
                               "spectral norm is at most 1, so the normalisation by max(sigma, 1) changes it only "
                               "through rounding)", at_least=1)
        eta_init: float = opt(1.5, "initial value of the learnable output scale eta (its sign is W_o's)", above=0.0)
        backend: str = backend_opt(BACKENDS)
        key_lift: str = opt("none", "feature map of keys and queries before the kernel: none, cg_invariant "
                                    "(|z_i|^2 of the even-odd pairs z_i, rank/2 features) or cg (those plus "
                                    "z_i^2, 3 rank/2 features); the kernel's rank is the lifted one",
                            choices=KEY_LIFTS, omit_at_default=True)

        def __post_init__(self):
            if self.key_lift != "none" and self.rank % 2:
                raise ValueError(f"key_lift={self.key_lift!r} pairs key components (2i, 2i+1) and needs an even "
                                 f"rank, got rank={self.rank}: use rank={self.rank + 1} or key_lift='none'")

    def __init__(self, d_model: int, options: "SKA.Options"):
        super().__init__(d_model, options)
        o = options
        H, r = o.n_heads, o.rank
        if o.value_dim == 0 and d_model % H:
            raise ValueError(f"ska: d_model={d_model} is not divisible by n_heads={H}; set value_dim explicitly "
                             f"or choose n_heads that divides d_model")
        self.P = o.value_dim or d_model // H
        #: the rank the kernel sees: the number of lifted features per head
        self.kernel_rank = lifted_dim(r, o.key_lift)
        self.q_proj = nn.Linear(d_model, H * r, bias=False)
        self.k_proj = nn.Linear(d_model, H * r, bias=False)
        self.v_proj = nn.Linear(d_model, H * self.P, bias=False)
        self.o_proj = nn.Linear(H * self.P, d_model, bias=False)
        self.gamma = nn.Parameter(torch.ones(H))
        self.eta = nn.Parameter(torch.tensor(float(o.eta_init)))
        # gains: gamma scales the spectrum of the operator (clamped to [1, gamma_max]) and eta the output;
        # decay would pull them towards 0, outside gamma's clamp and towards a silent layer
        no_weight_decay(self, "gamma", "eta")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        r = self.options.rank
        for w in (self.q_proj.weight, self.k_proj.weight):   # orthogonal per head (rows when r <= d_model)
            for h in range(self.options.n_heads):
                nn.init.orthogonal_(w.data[h * r:(h + 1) * r])
        nn.init.xavier_uniform_(self.v_proj.weight)
        nn.init.zeros_(self.o_proj.weight)
        with torch.no_grad():
            self.gamma.fill_(1.0)
            self.eta.fill_(self.options.eta_init)

    # --- helpers -------------------------------------------------------------------------------
    def _qkv(self, x):
        H, r = self.options.n_heads, self.options.rank
        q, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj])     # one matmul on the GPU plan
        return self._lift(q.unflatten(-1, (H, r))), self._lift(k.unflatten(-1, (H, r))), v.unflatten(-1, (H, self.P))

    def _lift(self, u):
        lift = self.options.key_lift
        if lift == "none":
            return u
        # degree 2: square in the kernels' compute precision (fp32 for bf16 / fp16 projections)
        return key_lift(u.to(compute_dtype(u.dtype)), lift)

    def _kw(self):
        o = self.options
        return dict(ridge=o.ridge, power=self.knob("power"), gamma=self.gamma, gamma_max=o.gamma_max,
                    normalisation=o.normalisation, power_iters=o.power_iters)

    def _out(self, y, x):
        # eta (a 0-dim tensor) keeps y's dtype; under autocast a 16-bit y enters the projection as it is
        return self.o_proj(keep_autocast_dtype(self.eta * y.flatten(-2), x))

    def _run(self, x, mask):
        o = self.options
        q, k, v = self._qkv(x)
        w = None if mask is None else mask.to(torch.float32)
        y = ska(q, k, v, w, mode=o.mode, chunk_size=o.chunk_size, backend=o.backend, **self._kw())
        return keep_autocast_dtype(self._out(y, x), x), (k, v, w)

    # --- contract ------------------------------------------------------------------------------
    def forward(self, x, mask=None):  # training skips the decode-state statistics
        return self._run(x, mask)[0]

    def prefill(self, x, mask=None):
        y, (k, v, w) = self._run(x, mask)
        return y, ska_final_state(k, v, w)

    def init_state(self, batch_size, device=None, dtype=None) -> State:
        sdt = compute_dtype(dtype or torch.float32)
        return ska_init_state(batch_size, self.options.n_heads, self.kernel_rank, self.P, device=device, dtype=sdt)

    def step(self, x_t, state):
        q, k, v = self._qkv(x_t)
        y, state = ska_step(q, k, v, state, update=self.options.mode == "chunk_causal", **self._kw())
        return self._out(y, x_t).to(x_t.dtype), state

    def state_size(self, seq_len: int) -> int:
        H, r, P = self.options.n_heads, self.kernel_rank, self.P
        return H * (2 * r * r + P * r + r + 1)

    # --- what the options make of it ---------------------------------------------------------
    @classmethod
    def non_causal_reason_for(cls, options) -> str | None:
        o = options
        if o.mode == "prefix":
            return "mode=prefix reads the statistics of the whole (masked) sequence at every position; use mode=chunk_causal"
        if o.normalisation == "seq_max":
            return ("normalisation=seq_max scales every key by the largest key of the whole sequence; "
                    "use normalisation=running_max")
        return None

    def decode_differs(self) -> str | None:
        o = self.options
        if o.mode == "chunk_causal" and o.chunk_size > 1:
            return (f"ska chunk_size={o.chunk_size}: decoding reads every earlier token, while the forward pass that "
                    f"trained and scores the model reads whole earlier chunks only; chunk_size=1 decodes as it trains")
        return None

    def dead_at(self, seq_len: int) -> str | None:
        """A readout is 0 unless its statistics hold a token, and with ``power >= 1`` a lag-one pair (else
        A = 0). chunk_causal position t reads the chunks before its own: with ``chunk_size = c >= 2`` the
        first live position is c (chunk 0 holds c - 1 pairs); with c = 1 it is 2 (one pair), or 1 at p = 0.
        prefix reads every token, so only ``T = 1`` with ``power >= 1`` is dead."""
        o, T = self.options, seq_len
        pairs = o.power >= 1
        if o.mode == "prefix":
            if pairs and T < 2:
                return (f"mode=prefix with power={o.power} needs two tokens for its lag-one operator at "
                        f"seq_len={T}; use power=0")
            return None
        first_live = o.chunk_size if o.chunk_size >= 2 or not pairs else 2
        if T > first_live:
            return None
        if T >= 3:
            fix = f"use chunk_size={max(2, T // 2)} (any value <= {T - 1}) or mode=prefix with a mask"
        elif T == 2:
            fix = "use chunk_size=1 with power=0, or mode=prefix with a mask"
        else:
            fix = "use mode=prefix with power=0"
        return (f"chunk_size={o.chunk_size}: chunk_causal reads only chunks finished before a position's own, "
                f"so at seq_len={T} no position reads anything (output 0, no gradient); {fix}")
