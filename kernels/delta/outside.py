"""The delta family through flash-linear-attention (the ``fla`` backend; CUDA only).

- ``n_h = 1``: ``chunk_gated_delta_rule`` (Yang et al., "Gated Delta Networks", arXiv:2412.06464);
  without a forget gate the gate is zero (fla's gated rule needs one), or ``chunk_delta_rule`` for
  half-precision inputs;
- ``n_h > 1``: ``chunk_gated_delta_product`` (Siems et al., "DeltaProduct", arXiv:2502.10297) for half
  precision; fla refuses fp32 there, so fp32 inputs use the interleave construction of
  :func:`kernels.delta.chunked.delta_product_via_rule` (the ``n_h`` sub-steps as one sequence ``n_h T``
  long, gate on sub-step 0, query on the last) through ``chunk_gated_delta_rule``.

Conventions match ours: ``q (B, T, H, K)``, ``k (B, T n_h, H, K)`` token-major, log gate in natural log,
state ``(B, H, K, V)``, ``o = scale * S^T q``. ``beta`` is passed as is (fla multiplies by it; values in
``(0, 2)`` give the negative eigenvalues). The package is imported here, on first use;
:func:`kernels.backend.resolve_backend` has already checked that it imports and that the inputs are on CUDA.
"""
from __future__ import annotations

import torch

from .chunked import delta_product_via_rule
from .reference import flatten_substeps


def _fla_gated_rule(q, k, v, beta, g, initial_state, chunk_size):
    """``rule`` for :func:`delta_product_via_rule`: fla's chunked gated delta rule (``q`` pre-scaled)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dtype = k.dtype
    g = torch.zeros(beta.shape, dtype=torch.float32, device=beta.device) if g is None else g.float()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, S = chunk_gated_delta_rule(q.to(dtype), k, v.to(dtype), g, beta.to(dtype), scale=1.0, initial_state=h0,
                                  output_final_state=True, chunk_size=min(64, max(16, int(chunk_size))))
    return o, S


def delta_product_fla(q, k, v, beta, g=None, num_householder: int = 1, scale=None, initial_state=None,
                      chunk_size: int = 64):
    """Same contract as :func:`kernels.delta.chunked.delta_product_chunked`."""
    B, T, H, K = q.shape
    n = num_householder
    k, v, beta = (flatten_substeps(x, n, T, what) for x, what in ((k, "k"), (v, "v"), (beta, "beta")))
    scale = K ** -0.5 if scale is None else scale
    dtype = q.dtype
    h0 = None if initial_state is None else initial_state.float().contiguous()
    if dtype != torch.float32 and n > 1:
        from fla.ops.gated_delta_product import chunk_gated_delta_product

        o, S = chunk_gated_delta_product(q, k.to(dtype), v.to(dtype), None if g is None else g.float(),
                                         beta.to(dtype), n, scale=scale, initial_state=h0, output_final_state=True)
        return o.to(dtype), S
    if dtype != torch.float32 and g is None:
        from fla.ops.delta_rule import chunk_delta_rule

        o, S = chunk_delta_rule(q, k.to(dtype), v.to(dtype), beta.to(dtype), scale=scale, initial_state=h0,
                                output_final_state=True)
        return o.to(dtype), S
    # fp32 (and gated n_h = 1): the gated delta rule, over the interleaved sequence when n_h > 1
    return delta_product_via_rule(_fla_gated_rule, q.to(dtype), k.to(dtype), v.to(dtype), beta, g, n, scale,
                                  initial_state, chunk_size)
