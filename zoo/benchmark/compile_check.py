"""Compile every Triton kernel of the zoo for NVIDIA GPUs on a machine without one.

``python -m zoo.benchmark.compile_check [--arch 80 90] [--quick] [--family ska ...] [--dtype bf16 ...]``

What is compiled is what the launchers launch: each family's Triton launcher (forward and backward)
runs on ``meta`` tensors inside :func:`kernels.launch.recording`, at realistic sizes (head dims 16 to
256 where the launcher accepts them, the chunk sizes in use, fp32 / bf16 / fp16 inputs, which each
launcher casts as it does on a GPU), and every distinct launch it records — one per autotune config
of an autotuned kernel — is compiled with ``triton.compile`` for each architecture (the Triton wheel
ships ``ptxas``). A launch fails when it does not compile or when its shared memory is above the
architecture's per-block limit; ``ptxas -v`` gives registers and spills. The process exits 1 if any
launch fails. ``--quick`` compiles one large size of every case: the largest for attention, delta, SSD and the slots,
the block scans at m = 4 and 16, SKA's largest tiles (rank 64, value dim 256, power 4) and its defaults (rank 32, power 2),
GKA and GLA at the GPU plan's chunk (64) and head dims 64 and 128 (GKA's reverse-Chebyshev backward at d 128
takes ptxas several minutes: quick compiles it at d 64);
``--ci`` compiles one launch per kernel and argument types of the quick grid (every
kernel in every dtype for both architectures, one configuration each: the test-suite's check);
``--markdown FILE`` writes the resource table into the marked block of ``FILE`` (BENCHMARKS.md).

Tensor cores: every result counts the ``mma.sync`` (sm_80 and up) and ``wgmma.mma_async`` (sm_90) instructions
in its PTX. A launch recorded for bf16 or fp16 inputs whose kernel calls ``tl.dot`` (itself or through a jitted
helper) must have at least one: a launcher that upcasts 16-bit inputs to fp32 before its products, or a
kernel that keeps every product in fp32, fails the check. A kernel whose products stay fp32 on purpose (a
triangular solve, say) names itself and the reason in its module's ``FP32_DOT_KERNELS`` dict. A launch of
fp32-only inputs must have no ``tf32`` product: fp32 inputs keep the exact fp32 path
(``input_precision="ieee"``).

16-bit arithmetic: with bf16 / fp16 inputs a kernel rounds to 16 bits only where it feeds a product or stores
a result; every sum, difference, product of elements, quotient and function value it computes is fp32. The
check reads the kernel's Triton IR and fails a launch with any rounding operation on 16-bit values (addition,
subtraction, multiplication, division, a math function, a reduction that combines them, a ``tl.dot`` that
accumulates in 16 bits). This is the one place it can be checked: the interpreter's bf16 arithmetic is
wrong (the CPU tests run fp16 and fp32), and an fp32 tolerance hides one rounding too many.

Run without ``TRITON_INTERPRET=1`` (the kernels must be real ``JITFunction`` objects).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, replace

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.attention.triton import attention_triton
from kernels.blockscan.gates import softmax_gates_triton
from kernels.blockscan.triton import block_scan_triton, jordan_scan_normed_triton, jordan_scan_triton
from kernels.delta.triton import delta_product_triton
from kernels.gate.beta import beta_scale_triton
from kernels.gate.triton import log_decay_triton, scaled_sigmoid_triton, step_size_triton
from kernels.gka.triton import chunk_solve_heads_first, gka_triton
from kernels.gla.triton import gla_triton
from kernels.launch import Launch, jit_function, recording
from kernels.norm.triton import gated_rms_norm_triton, l2_normalize_triton, rms_norm_triton
from kernels.rope.triton import rotary_triton
from kernels.scan.triton import chunk_scan_triton
from kernels.shortconv.triton import causal_conv_triton
from kernels.ska.triton import ska_chain_triton, ska_triton
from kernels.slots.triton import kronecker_topk_triton, slot_memory_triton
from kernels.ssd.triton import ssd_triton
from kernels.swiglu.triton import swiglu_triton

from .marked_block import write_block

#: per-block shared memory limit (bytes) of each architecture: the opt-in maximum of one thread block.
#: sm_100 compiles with the wheel's ptxas-blackwell; it is opt-in (--arch 80 90 100) to keep CI short.
SHARED_LIMIT = {80: 166912, 90: 232448, 100: 232448}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (16, 32, 64, 128, 256)


def _meta(*shape, dtype=torch.float32, grad=True):
    x = torch.empty(shape, device="meta", dtype=dtype)
    return x.requires_grad_(grad and dtype.is_floating_point)


def _fwd_bwd(outputs):
    """Backward through every floating output (a sum of them), so the backward kernels launch too."""
    outs = [o for o in (outputs if isinstance(outputs, (tuple, list)) else (outputs,)) if torch.is_tensor(o)]
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    loss.backward()


# --------------------------------------------------------------------------------------------------
# the cases: (family, sizes label, thunk) — a thunk runs a launcher forward and backward
# --------------------------------------------------------------------------------------------------
def _attention(dt, quick):
    for D in (HEAD_DIMS[-2:] if quick else HEAD_DIMS):
        for causal in ((True,) if quick else (True, False)):
            def run(D=D, causal=causal):
                q, k, v = (_meta(2, 1024, 4, D, dtype=dt) for _ in range(3))
                _fwd_bwd(attention_triton(q, k, v, causal=causal))
            yield f"D={D} causal={causal}", run

    def grouped(D=HEAD_DIMS[-2]):  # grouped-query attention: 4 query heads read 2 key/value heads (GROUP 2)
        q = _meta(2, 1024, 4, D, dtype=dt)
        k, v = (_meta(2, 1024, 2, D, dtype=dt) for _ in range(2))
        _fwd_bwd(attention_triton(q, k, v, causal=True))
    yield f"D={HEAD_DIMS[-2]} causal=True kv_heads=2", grouped


def _delta(dt, quick):
    for D in (HEAD_DIMS[-2:] if quick else HEAD_DIMS):
        for chunk in ((64,) if quick else (16, 32, 64)):
            def run(D=D, chunk=chunk):
                B, T, H, n = 2, 512, 4, 2
                q = _meta(B, T, H, D, dtype=dt)
                k, v = _meta(B, T, n, H, D, dtype=dt), _meta(B, T, n, H, D, dtype=dt)
                beta, g = _meta(B, T, n, H, dtype=dt), _meta(B, T, H, dtype=dt)
                _fwd_bwd(delta_product_triton(q, k, v, beta, g, num_householder=n, chunk_size=chunk,
                                              initial_state=_meta(B, H, D, D, dtype=torch.float32)))
            yield f"K=V={D} chunk={chunk}", run


def _ssd(dt, quick):
    grid = ((64, 64, 256), (128, 128, 64)) if quick else [
        (N, P, L) for N in (16, 64, 128) for P in HEAD_DIMS for L in (32, 64, 128, 256)]
    for N, P, L in grid:
        def run(N=N, P=P, L=L):
            B, T, H = 2, 1024, 4
            x, Bm, Cm = _meta(B, T, H, P, dtype=dt), _meta(B, T, H, N, dtype=dt), _meta(B, T, H, N, dtype=dt)
            dtt, A = _meta(B, T, H, dtype=dt), _meta(H, dtype=torch.float32)
            _fwd_bwd(ssd_triton(x, dtt, A, Bm, Cm, chunk_size=L, initial_state=_meta(B, H, N, P, dtype=dt),
                                D=_meta(H, dtype=torch.float32)))      # with Mamba-2's skip, as the mixer runs it
        yield f"N={N} P={P} chunk={L}", run


def _ska(dt, quick):
    # quick: the largest tiles first (rank 64, value dim 256, power 4: the backward's shared memory and
    # spills peak there; one H100 run failed at rank 64, value dim 128 before the backward's token tile
    # shrank with them), then the mixer's defaults. Each case runs the readout alone (the chain) and the
    # whole op (statistics, operator, readout), masked in chunk_causal mode and unmasked in prefix mode.
    grid = ((64, 256, 64, 4), (32, 64, 64, 2)) if quick else [
        (r, P, cs, p) for r in (16, 32, 64) for P in HEAD_DIMS for cs in (32, 64, 128) for p in (1, 2, 3, 4)]
    for r, P, cs, p in grid:
        def run(r=r, P=P, cs=cs, p=p):
            B, T, H = 2, 1024, 4
            n = T // cs
            mats = [_meta(B, n, H, r, r, dtype=dt), _meta(B, n, H, r, r, dtype=dt), _meta(B, n, H, P, r, dtype=dt)]
            _fwd_bwd(ska_chain_triton(*mats, _meta(B, T, H, r, dtype=dt), power=p, chunk_size=cs))
            for mode, w in (("chunk_causal", _meta(B, T, grad=False)), ("prefix", None)):
                q, k = _meta(B, T, H, r, dtype=dt), _meta(B, T, H, r, dtype=dt)
                _fwd_bwd(ska_triton(q, k, _meta(B, T, H, P, dtype=dt), w, gamma=_meta(H), mode=mode, chunk_size=cs,
                                    power=p, normalisation="running_max"))
        yield f"r={r} P={P} chunk={cs} power={p}", run


def _gka(dt, quick):
    # quick: the GPU plan's chunk (64) at head dims 64 and 128, both gradient modes; then the solve stage alone
    # (heads-first, cumulative decays given: other constexprs of the same kernels)
    grid = ((64, 64, "implicit"), (64, 64, "reverse_chebyshev"), (128, 64, "implicit")) if quick else [
        (d, C, grad) for d in (16, 32, 64, 128) for C in (16, 32, 64) for grad in ("implicit", "reverse_chebyshev")]
    for d, C, grad in grid:
        def run(d=d, C=C, grad=grad):
            B, T, H = 2, 512, 4
            q, k, v = (_meta(B, T, H, d, dtype=dt) for _ in range(3))
            g, alpha = _meta(B, T, H, dtype=dt), _meta(B, T, H, dtype=dt)
            init = (_meta(B, H, d, d, dtype=torch.float32), _meta(B, H, d, d, dtype=torch.float32))
            o, (Hs, Us) = gka_triton(q, k, v, g, alpha, chunk_size=C, num_iter=30, grad=grad, initial_state=init)
            _fwd_bwd((o, Hs, Us))
        yield f"d={d} chunk={C} grad={grad}", run
    for d, C, grad in grid[:2]:
        def run_stage(d=d, C=C, grad=grad):
            b, h, n = 2, 4, 8
            vec = [_meta(b, h, n, C, d, dtype=dt) for _ in range(2)]
            tok = [_meta(b, h, n, C, dtype=torch.float32) for _ in range(2)]
            _fwd_bwd(chunk_solve_heads_first(_meta(b, h, n, d, d), vec[0], tok[0], tok[1], vec[1], num_iter=30,
                                             grad=grad))
        yield f"solve stage d={d} chunk={C} grad={grad}", run_stage


def _gla(dt, quick):
    grid = ((64, 64), (128, 64)) if quick else [(d, C) for d in HEAD_DIMS for C in (16, 32, 64)]
    for d, C in grid:
        def run(d=d, C=C):
            B, T, H = 2, 512, 4
            q, k, v = (_meta(B, T, H, d, dtype=dt) for _ in range(3))
            o, U = gla_triton(q, k, v, _meta(B, T, H, dtype=dt), chunk_size=C,
                              initial_state=_meta(B, H, d, d, dtype=torch.float32))
            _fwd_bwd((o, U))
        yield f"d={d} chunk={C}", run


def _blockscan(dt, quick):
    # quick: m = 4 (the mixers' default: register products) and m = 16 (the chunk transition as a tl.dot)
    for m in ((4, 16) if quick else (1, 2, 4, 8, 16, 32)):
        def run(m=m):
            B, T, N = 2, 256, max(1, 1024 // m)  # d_model 1024 in blocks of m: the tiles of a real layer
            h0 = _meta(B, N, m, dtype=dt)
            _fwd_bwd(block_scan_triton(_meta(B, T, N, m, m, dtype=dt), _meta(B, T, N, m, dtype=dt), h0))
            _fwd_bwd(block_scan_triton(_meta(B, T, N, m, m, dtype=dt), _meta(B, T, N, m, dtype=dt)))
            lam, c = _meta(B, T, N, dtype=dt), _meta(B, T, N, dtype=dt)
            _fwd_bwd(jordan_scan_triton(lam, c, _meta(B, T, N, m, dtype=dt), h0))
            _fwd_bwd(jordan_scan_triton(lam, c, _meta(B, T, N, m, dtype=dt))[0])
            _fwd_bwd(jordan_scan_normed_triton(lam, c, _meta(B, T, N, m, dtype=dt), _meta(N, m, dtype=dt),
                                               _meta(N, m, dtype=dt), initial_state=h0))
            _fwd_bwd(softmax_gates_triton(_meta(B, T, N * m * (m + 1), dtype=dt), _meta(B, T, N * m, dtype=dt), m))
        yield f"m={m}", run


def _slots(dt, quick):
    # M <= 256 runs the chunked kernels (64: the mixer's default; 256: the largest, in chunks of 16), M = 1024 the
    # sparse scan; the addressing of M = d_p^U slots at d_p = 4 (the mixer's default) and d_p = 32 (M = 1024), on
    # the joint write-and-read logits of a layer (a slice of its projections, in the input dtype)
    grid = ((4, 128, 64), (8, 256, 256), (8, 256, 1024)) if quick else [
        (K, dv, M) for K in (1, 2, 4, 8) for dv in HEAD_DIMS for M in (64, 256, 1024)]
    for K, dv, M in grid:
        def run(K=K, dv=dv, M=M):
            B, T, H = 2, 256, 4
            idx = torch.empty(B, T, H, K, device="meta", dtype=torch.int64)
            w = [_meta(B, T, H, K, dtype=dt) for _ in range(2)]
            o, (S, z) = slot_memory_triton(idx, w[0], idx, w[1], _meta(B, T, H, dv, dtype=dt),
                                           _meta(H, dtype=dt), num_slots=M)
            _fwd_bwd((o, S, z))
            for dp in (4, 32):
                U = round(math.log(M, dp))
                if dp ** U == M:
                    a = H * U * dp
                    logits = _meta(B, T, 2 * a + H * dv, dtype=dt)[..., :2 * a].unflatten(-1, (2, H, U, dp))
                    _fwd_bwd(kronecker_topk_triton(logits, K, 1.0, renormalize=True)[1])
        yield f"K={K} d_v={dv} M={M}", run


def _scan(dt, quick):
    # state sizes: GLA at head dim 16 and 128, GKA's (H, U) pair at head dim 128
    for D in ((2 * 128 * 128,) if quick else (16 * 16, 128 * 128, 2 * 128 * 128)):
        def run(D=D):
            L, n = 8, 64
            a, X = _meta(L, n, dtype=dt), _meta(L, n, D, dtype=dt)
            _fwd_bwd(chunk_scan_triton(a, X, _meta(L, D, dtype=dt)))
            _fwd_bwd(chunk_scan_triton(a, X, None)[1])
        yield f"state={D}", run


def _shortconv(dt, quick):
    widths = [(6144, True, 4), (768, True, 9)]          # filters of at most 4 taps and wider ones: two backwards
    for C, act, k in (widths if quick else [(C, act, 4) for C in (48, 768, 6144) for act in (True, False)] + widths[1:]):
        def run(C=C, act=act, k=k):
            _fwd_bwd(causal_conv_triton(_meta(2, 1024, C, dtype=dt), _meta(C, k, dtype=dt), _meta(C, dtype=dt), act))
        yield f"C={C} activation={act} k={k}", run


def _norm(dt, quick):
    for D in ((128, 4096) if quick else (16, 64, 128, 256, 1024, 4096)):
        def run(D=D):
            if D <= 256:
                _fwd_bwd(l2_normalize_triton(_meta(2, 512, 8, D, dtype=dt)))
            _fwd_bwd(gated_rms_norm_triton(_meta(2, 512, D, dtype=dt), _meta(2, 512, D, dtype=dt), _meta(D, dtype=dt)))
            _fwd_bwd(rms_norm_triton(_meta(2, 512, D, dtype=dt), _meta(D)))
        yield f"D={D}", run


def _gate(dt, quick):
    for H in ((64,) if quick else (4, 16, 64)):
        def run(H=H):
            _fwd_bwd(log_decay_triton(_meta(2, 1024, H, dtype=dt), _meta(H, dtype=torch.float32),
                                      _meta(H, dtype=torch.float32)))
            _fwd_bwd(step_size_triton(_meta(2, 1024, H, dtype=dt), _meta(H, dtype=torch.float32), 1e3, dt))
            _fwd_bwd(scaled_sigmoid_triton(_meta(2, 1024, 5 * H, dtype=dt)[..., H:2 * H], 2.0))
        yield f"H={H}", run
    for H, D in (((8, 128),) if quick else ((4, 64), (8, 128), (16, 256))):
        def beta(H=H, D=D):   # the GLA / GKA beta gate on column blocks of a layer's projections
            wide = _meta(2, 1024, H * (2 * D + 1), dtype=dt)
            _fwd_bwd(beta_scale_triton(wide[..., :H * D].unflatten(-1, (H, D)),
                                       wide[..., H * D:2 * H * D].unflatten(-1, (H, D)), wide[..., 2 * H * D:]))
        yield f"beta H={H} D={D}", beta


def _rope(dt, quick):
    for D in ((128,) if quick else (32, 64, 96, 128, 256)):
        def run(D=D):
            _fwd_bwd(rotary_triton(_meta(2, 1024, 3 * 8, D, dtype=dt), 0, 10000.0, rotated=16))
        yield f"D={D}", run


def _swiglu(dt, quick):
    for F in ((2816,) if quick else (48, 1376, 2816)):
        def run(F=F):
            _fwd_bwd(swiglu_triton(_meta(2, 1024, 2 * F, dtype=dt)))
        yield f"F={F}", run


FAMILIES = {"attention": _attention, "delta": _delta, "ssd": _ssd, "ska": _ska, "gka": _gka, "gla": _gla,
            "blockscan": _blockscan, "slots": _slots, "scan": _scan, "shortconv": _shortconv, "norm": _norm,
            "gate": _gate, "rope": _rope, "swiglu": _swiglu}


#: (family, dtype, sizes, message) of every case a launcher refused in the last enumeration
refused: list = []


def enumerate_launches(families=None, dtypes=None, quick: bool = False) -> list[Launch]:
    """Every distinct launch the launchers make over the size grid (with the cases that recorded it)."""
    seen: dict = {}
    refused.clear()
    for fam in families or FAMILIES:
        for dname in dtypes or DTYPES:
            for sizes, run in FAMILIES[fam](DTYPES[dname], quick):
                with recording(((fam, dname, sizes),)) as recs:
                    try:
                        run()
                    except ValueError as e:  # the launcher refuses these inputs with one line: nothing to compile
                        refused.append((fam, dname, sizes, str(e)))
                        continue
                for rec in recs:
                    first = seen.setdefault(rec.key(), rec)
                    new = tuple(tag for tag in rec.tags if tag not in first.tags)  # a case launching it twice: once
                    if first is not rec and new:
                        seen[rec.key()] = replace(first, tags=first.tags + new)
    return list(seen.values())


# --------------------------------------------------------------------------------------------------
# compiling
# --------------------------------------------------------------------------------------------------
@dataclass
class Result:
    launch: Launch
    arch: int
    error: str | None = None
    shared: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    seconds: float = 0.0
    tensor_core_ops: int = 0             # mma.sync / wgmma instructions in the PTX
    tf32_ops: int = 0                    # of those, products on tf32 operands
    dot: bool = False                    # the kernel calls tl.dot
    fp32_dots_because: str | None = None  # the kernel's declared reason to keep 16-bit products in fp32
    half_arith_ops: int = 0              # rounding operations on bf16/fp16 values in the Triton IR

    @property
    def sixteen_bit(self) -> bool:
        """Recorded for bf16 or fp16 inputs."""
        return bool(_case_dtypes(self.launch) & {"bf16", "fp16"})

    @property
    def missing_tensor_cores(self) -> bool:
        """A ``tl.dot`` kernel launched for 16-bit inputs that compiled to no tensor-core instruction."""
        return (self.error is None and self.sixteen_bit and self.dot and self.tensor_core_ops == 0
                and not self.fp32_dots_because)

    @property
    def inexact_fp32(self) -> bool:
        """fp32-only inputs multiplied in tf32 (fp32 inputs must keep the exact fp32 products)."""
        return self.error is None and _input_dtype(self.launch) == "fp32" and self.tf32_ops > 0

    @property
    def sixteen_bit_arithmetic(self) -> bool:
        """Elementwise arithmetic, a reduction or an accumulation in bf16/fp16 (only operands may be 16-bit)."""
        return self.error is None and self.half_arith_ops > 0

    @property
    def over_shared(self) -> bool:
        return self.error is None and self.shared > SHARED_LIMIT[self.arch]

    @property
    def ok(self) -> bool:
        return (self.error is None and not self.over_shared and not self.missing_tensor_cores and not self.inexact_fp32
                and not self.sixteen_bit_arithmetic)


def _ptxas_numbers(log: str) -> tuple[int, int, int]:
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(regs[-1]) if regs else 0, int(spills[-1][0]) if spills else 0, int(spills[-1][1]) if spills else 0)


def _ptxas_log(ptx: str, arch: int) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        out = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    return out.stderr


#: PTX instructions that run on tensor cores: warp-level ``mma.sync`` (sm_80 and up), warpgroup ``wgmma`` (sm_90)
_TENSOR_CORE_OP = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)\b")
_TF32_OP = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)\S*\.tf32\b")


#: Triton IR operations that round their result, on a bf16/fp16 tensor or scalar (a reduction's combining region
#: holds scalar ones): arithmetic, math functions (but the exact ``absf``), and ``tt.dot`` accumulating in 16 bits.
#: Conversions, comparisons, selects, negation, max and min are exact and not listed.
_HALF_ARITH_OP = re.compile(
    r"= (?:arith\.(?:addf|subf|mulf|divf|remf)|math\.(?!absf\b)\w+|tt\.precise_\w+|tt\.extern_elementwise)\b[^\n]*"
    r":\s*(?:tensor<[^>\n]*x)?(?:bf16|f16)>?\s*(?:loc\(|$)"
    r"|= tt\.dot\b[^\n]*->\s*tensor<[^>\n]*x(?:bf16|f16)>", re.M)


def half_arith_count(ttir: str) -> int:
    """Rounding operations on 16-bit values in a kernel's Triton IR (:data:`_HALF_ARITH_OP`)."""
    return len(_HALF_ARITH_OP.findall(ttir))


def tensor_core_counts(ptx: str) -> tuple[int, int]:
    """``(tensor-core product instructions, those of them on tf32 operands)`` in a PTX listing."""
    return len(_TENSOR_CORE_OP.findall(ptx)), len(_TF32_OP.findall(ptx))


def _jitted_callees(fn) -> list:
    """The jitted functions that ``fn`` (a JITFunction) calls by name."""
    scope = fn.fn.__globals__
    calls = (node.func.id for node in ast.walk(ast.parse(textwrap.dedent(fn.src)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name))
    return [scope[name] for name in calls if hasattr(scope.get(name), "arg_names") and hasattr(scope[name], "fn")]


def calls_dot(kernel) -> bool:
    """True when the jitted ``kernel`` calls ``tl.dot``, itself or through a jitted helper."""
    seen, todo = set(), [jit_function(kernel)]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if re.search(r"\btl\.dot\(", fn.src):
            return True
        todo.extend(_jitted_callees(fn))
    return False


def fp32_dot_reason(kernel) -> str | None:
    """Why ``kernel`` keeps its products in fp32 for 16-bit inputs (its module's ``FP32_DOT_KERNELS``), or None."""
    fn = jit_function(kernel)
    module = sys.modules.get(fn.fn.__module__)
    return getattr(module, "FP32_DOT_KERNELS", {}).get(fn.fn.__name__)


def _case_dtypes(launch: Launch) -> set:
    """The input dtypes of the cases that recorded ``launch`` (``fp32``, ``bf16``, ``fp16``)."""
    return {tag[1] for tag in launch.tags if len(tag) > 1}


def compile_launch(launch: Launch, arch: int) -> Result:
    """Compile one launch for ``sm_<arch>``; never raises (a failure is the result's ``error``)."""

    sig = dict(launch.signature)
    sig.update({name: "constexpr" for name, _ in launch.constexprs})
    index = jit_function(launch.kernel).arg_names.index
    attrs = {(index(name),): [["tt.divisibility", 16]] for name in launch.aligned}
    src = ASTSource(fn=launch.kernel, signature=sig, constexprs=dict(launch.constexprs), attrs=attrs)
    res = Result(launch, arch, dot=calls_dot(launch.kernel), fp32_dots_because=fp32_dot_reason(launch.kernel))
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            kern = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
        res.shared = int(kern.metadata.shared)
        res.tensor_core_ops, res.tf32_ops = tensor_core_counts(kern.asm["ptx"])
        res.half_arith_ops = half_arith_count(kern.asm["ttir"])
        text = log.getvalue()
        if "Used " not in text:  # a cached kernel: ptxas did not run, so run it on the PTX for its numbers
            text = _ptxas_log(kern.asm["ptx"], arch)
        res.registers, res.spill_stores, res.spill_loads = _ptxas_numbers(text)
    except Exception as e:  # noqa: BLE001 - any compiler failure is reported, with its first line
        msg = str(e).strip().splitlines()
        res.error = f"{type(e).__name__}: {' '.join(msg[-3:])[:300]}" if msg else type(e).__name__
    res.seconds = time.perf_counter() - t0
    return res


def _describe(launch: Launch) -> str:
    keep = {k: v for k, v in launch.constexprs}
    consts = " ".join(f"{k}={v}" for k, v in keep.items())
    return f"{consts} w={launch.num_warps} s={launch.num_stages}"


def _input_dtype(launch: Launch) -> str:
    kinds = sorted({t[1:] for _, t in launch.signature if t.startswith("*") and t[1:] in DTYPES})
    return "/".join(kinds)


def table_rows(results: list[Result]) -> list[list[str]]:
    rows = []
    for r in sorted(results, key=lambda r: (r.launch.name, r.arch, _input_dtype(r.launch), _describe(r.launch))):
        if r.error:
            status = "FAIL: " + r.error
        elif r.over_shared:
            status = "FAIL: shared memory above the limit"
        elif r.missing_tensor_cores:
            status = "FAIL: tl.dot with 16-bit inputs compiled to no mma/wgmma"
        elif r.inexact_fp32:
            status = "FAIL: fp32 inputs multiplied in tf32"
        elif r.sixteen_bit_arithmetic:
            status = f"FAIL: {r.half_arith_ops} rounding operations on 16-bit values (compute in fp32)"
        else:
            status = "ok"
        rows.append([r.launch.name, f"sm_{r.arch}", _input_dtype(r.launch), _describe(r.launch),
                     f"{r.shared / 1024:.1f} / {SHARED_LIMIT[r.arch] // 1024} KB", str(r.registers),
                     f"{r.spill_stores}/{r.spill_loads}", _tensor_core_cell(r), status])
    return rows


HEADER = ["kernel", "arch", "pointers", "constexprs, warps, stages", "shared / limit", "regs", "spill st/ld (B)",
          "mma", "status"]


def _tensor_core_cell(r: Result) -> str:
    """The tensor-core column: instruction count, ``-`` for a kernel without ``tl.dot``, the fp32 reason's mark."""
    if not r.dot:
        return "-"
    return f"{r.tensor_core_ops}" + (" (fp32 by design)" if r.fp32_dots_because and not r.tensor_core_ops else "")


def markdown(results: list[Result], command: str, ci: bool = False) -> str:
    which = ("the first launch of every kernel and argument types (one configuration each, as CI compiles)"
             if ci else "every distinct launch the launchers make")
    lines = [f"Generated by `{command}` (Triton {_triton_version()}, ptxas of the Triton wheel): {which} "
             "at the sizes of `zoo/benchmark/compile_check.py`, per architecture. "
             "`pointers` lists the floating element types the kernel reads and writes (launchers that compute "
             "in fp32 cast bf16/fp16 inputs first, so their kernels appear as fp32 only).", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    if refused:
        lines += ["", "Cases the launchers refuse with one line (nothing is launched):", ""]
        lines += [f"- {fam} {dname} {sizes}: {msg}" for fam, dname, sizes, msg in refused]
    return "\n".join(lines)


def _triton_version() -> str:
    return triton.__version__


BEGIN, END = "<!-- compile-check:begin -->", "<!-- compile-check:end -->"


def one_per_kernel_and_dtype(launches: list[Launch]) -> list[Launch]:
    """The first launch of each (kernel, argument types): every kernel in every dtype, one config each."""
    first: dict = {}
    for launch in launches:
        first.setdefault((launch.name, launch.signature), launch)
    return list(first.values())


def run_check(archs, families=None, dtypes=None, quick=False, jobs=1, progress=None, ci=False) -> list[Result]:
    launches = enumerate_launches(families, dtypes, quick or ci)
    if ci:
        launches = one_per_kernel_and_dtype(launches)
    work = [(launch.on_arch(arch), arch) for launch in launches for arch in archs]
    if jobs <= 1:
        results = []
        for i, (launch, arch) in enumerate(work):
            results.append(compile_launch(launch, arch))
            if progress:
                progress(i + 1, len(work), results[-1])
        return results
    global _WORK
    _WORK = work
    results = [None] * len(work)
    with mp.get_context("fork").Pool(jobs) as pool:
        for n, (i, res) in enumerate(pool.imap_unordered(_compile_index, range(len(work)))):
            res.launch = work[i][0]  # kernels do not pickle: the worker sends its result without one
            results[i] = res
            if progress:
                progress(n + 1, len(work), res)
    return results


_WORK: list = []


def _as_dict(r: Result) -> dict:
    return {"kernel": r.launch.name, "arch": r.arch, "config": _describe(r.launch), "pointers": _input_dtype(r.launch),
            "ok": r.ok, "status": table_rows([r])[0][-1], "shared": r.shared, "shared_limit": SHARED_LIMIT[r.arch],
            "registers": r.registers, "spill_stores": r.spill_stores, "spill_loads": r.spill_loads,
            "calls_dot": r.dot, "tensor_core_ops": r.tensor_core_ops, "tf32_ops": r.tf32_ops,
            "fp32_dots_because": r.fp32_dots_because, "half_arith_ops": r.half_arith_ops,
            "case_dtypes": sorted(_case_dtypes(r.launch)),
            "seconds": round(r.seconds, 2), "recorded_for": sorted({t[1] for t in r.launch.tags}),
            "cases": [" ".join(t) for t in r.launch.tags]}


def _compile_index(i):
    res = compile_launch(*_WORK[i])
    res.launch = None
    return i, res


def interpreting_refused(command: str) -> bool:
    """True (after saying so) where ``TRITON_INTERPRET=1`` would hand ``command`` interpreted kernels to compile."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    print(f"{command}: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)", file=sys.stderr)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.benchmark.compile_check", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_LIMIT))
    p.add_argument("--family", nargs="+", choices=sorted(FAMILIES))
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="one large size of every case (see the module docstring)")
    p.add_argument("--ci", action="store_true",
                   help="the quick grid, one launch per kernel and argument types (every kernel, every dtype, "
                        "both architectures; what the test-suite compiles)")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--markdown", metavar="FILE", help="write the resource table into FILE's compile-check block")
    p.add_argument("--json", metavar="FILE", help="write every result as JSON to FILE")
    p.add_argument("--list", action="store_true", help="list the launches without compiling")
    args = p.parse_args(argv)
    if interpreting_refused("compile_check"):
        return 2
    if args.list:
        launches = enumerate_launches(args.family, args.dtype, args.quick or args.ci)
        for launch in one_per_kernel_and_dtype(launches) if args.ci else launches:
            print(launch.name, _input_dtype(launch), _describe(launch), "|", *launch.tags[0])
        return 0

    def progress(i, n, r):
        print(f"[{i}/{n}] {r.launch.name} sm_{r.arch} {_describe(r.launch)} {r.seconds:.1f}s "
              f"{'ok' if r.ok else 'FAIL'}", file=sys.stderr, flush=True)

    results = run_check(args.arch, args.family, args.dtype, args.quick, args.jobs, progress, ci=args.ci)
    rows = table_rows(results)
    widths = [max(len(HEADER[i]), *(len(r[i]) for r in rows)) for i in range(len(HEADER))] if rows else []
    print("  ".join(h.ljust(w) for h, w in zip(HEADER, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    failed = [r for r in results if not r.ok]
    print(f"{len(results)} compiled, {len(failed)} failed", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [_as_dict(r) for r in results], "refused": refused}, f, indent=1)
    if args.markdown:
        cmd = "python -m zoo.benchmark.compile_check --arch " + " ".join(map(str, args.arch))
        cmd += "".join(f" --{k} " + " ".join(getattr(args, k)) for k in ("family", "dtype") if getattr(args, k))
        cmd += " --quick" * args.quick + " --ci" * args.ci + f" --markdown {args.markdown}"
        write_block(args.markdown, markdown(results, cmd, args.ci), BEGIN, END)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
