"""How fast could GKA train at T = 2048 on this CPU if its Chebyshev solve did nothing but its matrix products?

GKA ("Gated KalmaNet", arXiv:2511.21016) solves one ridge system per token with r = 30 Chebyshev
iterations, once in the forward and once more in the implicit backward. Each iteration is three batched
matrix products per chunk (``xi H0^T``, ``xi K^T``, ``(xi K^T * M) K``) plus element-wise updates. This
script times, at the shape of ``recipes/ablations/lm_bytes.yaml`` (batch 4, T 2048, 2 heads of 32, GKA
chunk 16, one thread), in one run:

- the forward solve as the library runs it (``kernels.gka.chebyshev``, cache-sized blocks of chunks), on
  the operands a real GKA layer hands it;
- the same loop with only its matrix products (same operands, shapes and blocks): no element-wise
  fusion, however perfect, can make the solve faster than this;
- one GKA layer, the same layer with ``num_iter = 0`` (no solve: gated linear attention) and one causal
  attention layer, forward + backward.

It prints the GKA layer's time with the element-wise work of both solves (forward and backward) removed,
``gka - 2 (solve - matmuls only)``, next to attention's: the best a fused CPU solve could reach.

    python scripts/gka_solve_floor.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.gka.chunked as gka_chunked  # noqa: E402
from kernels.gka.chebyshev import iterative_solve  # noqa: E402
from mixers.base import build_mixer  # noqa: E402

BATCH, SEQ_LEN, D_MODEL, NUM_ITER = 4, 2048, 64, 30
GKA = {"n_heads": 2, "head_dim": 32, "chunk_size": 16}


def captured_solve(mixer, x):
    """The operator, parameters and right-hand side of the first solve of ``mixer(x)``."""
    seen = []

    def record(op, params, q, mu, L, **kw):
        seen.append((op, params, q, mu, L))
        return q

    with torch.no_grad(), mock.patch.object(gka_chunked, "iterative_solve", record):
        mixer(x)
    op, params, q, mu, L = seen[0]
    return op, tuple(p.detach() for p in params), q.detach(), mu, L


def solve_as_implemented(op, params, q, mu, L):
    iterative_solve(op, params, q, mu, L, num_iter=NUM_ITER)


def solve_matmuls_only(op, params, q, mu, L):
    blocks = op.blocks(params, q, mu, L) or [(op, params, q, mu, L, None)]
    for _, (H0, K, *_params), qb, *_ in blocks:
        K, H0, qb = (t.reshape(-1, *t.shape[-2:]) for t in (K, H0, qb))
        Kt, H0t = K.transpose(-1, -2).contiguous(), H0.transpose(-1, -2).contiguous()
        xi, res = qb.clone(), torch.empty_like(qb)
        P = xi.new_empty(xi.shape[0], K.shape[-2], K.shape[-2])
        for _ in range(NUM_ITER):
            torch.bmm(xi, H0t, out=res)
            torch.bmm(xi, Kt, out=P)
            res.baddbmm_(P, K, alpha=-1.0)


def train_step(mixer, x):
    mixer(x).square().mean().backward()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median reported)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ_LEN, D_MODEL)
    layers = {"gka": build_mixer("gka", D_MODEL, GKA),
              "gka num_iter=0": build_mixer("gka", D_MODEL, {**GKA, "num_iter": 0}),
              "attention": build_mixer("attention", D_MODEL, {"n_heads": 2})}
    operands = captured_solve(layers["gka"], x)
    xg = x.clone().requires_grad_(True)
    jobs = {"solve, as implemented": lambda: solve_as_implemented(*operands),
            "solve, matrix products only": lambda: solve_matmuls_only(*operands),
            **{f"{name} layer fwd+bwd": (lambda m=m: train_step(m, xg)) for name, m in layers.items()}}
    times = {name: [] for name in jobs}
    for job in jobs.values():
        job()  # warm-up
    for _ in range(args.rounds):
        for name, job in jobs.items():
            start = time.perf_counter()
            job()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"torch {torch.__version__}, 1 thread, batch {BATCH}, T {SEQ_LEN}, GKA {GKA}, r = {NUM_ITER}; "
          f"median of {args.rounds} interleaved rounds")
    for name, value in ms.items():
        print(f"  {name:32s} {value:8.1f} ms")
    elementwise = ms["solve, as implemented"] - ms["solve, matrix products only"]
    best = ms["gka layer fwd+bwd"] - 2 * elementwise
    print(f"  {'gka with free element-wise work':32s} {best:8.1f} ms  (gka - 2 x {elementwise:.1f})")
    print(f"attention / gka: {ms['attention layer fwd+bwd'] / ms['gka layer fwd+bwd']:.2f}x as implemented, "
          f"{ms['attention layer fwd+bwd'] / best:.2f}x at best")


if __name__ == "__main__":
    main()
