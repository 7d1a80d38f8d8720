"""Time the delta family's Triton kernels against flash-linear-attention's on one GPU, in one command.

    python scripts/gpu_delta_check.py                 # CUDA: bf16, B 1, H 8, K = V = 128, T 16384 and 65536
    python scripts/gpu_delta_check.py --dry-run       # anywhere: the same pipeline at toy sizes (interpreter)

Measured, forward and forward+backward, CUDA events around each call after warm-up calls (the first
call compiles our kernels and runs flash-linear-attention's autotuning, so neither is in the timings;
the first call's time is reported separately):

- ours ``delta_rule`` (``backend="triton"``) against fla's ``chunk_delta_rule`` (no gate) and ours with a
  forget gate against fla's ``chunk_gated_delta_rule``, at n_h 1;
- ours at n_h 2 (DeltaProduct, Siems et al., arXiv:2502.10297) against ours at n_h 1, same gate.

Prints one JSON line: times in ms, the ratios (ours / theirs; n_h 2 / n_h 1) and whether each meets its
goal (at most 1.2x fla, n_h 2 at most 2.4x n_h 1); exits 1 on a miss (not in ``--dry-run``). A
comparison fla refuses (its gated backward on a Hopper GPU with Triton below 3.7.1) is reported under
``errors`` with a null ratio. ``--dry-run``
runs on the CPU through the Triton interpreter at T 32 and 64 in fp16, with our chunked PyTorch backend
standing in for fla; its numbers mean nothing, it checks that the pipeline runs.

:func:`measure_delta` is the same measurement as a function (``scripts/gpu_speed.sh`` imports it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: goals of the measurement (ours over fla; DeltaProduct n_h 2 over n_h 1)
MAX_VS_FLA = 1.2
MAX_N2_VS_N1 = 2.4


def _inputs(B, T, H, K, V, n, gate, dtype, device, grad):
    import torch
    import torch.nn.functional as F

    def leaf(x):
        return x.detach().requires_grad_(grad)

    q = leaf(F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype))
    k = leaf(F.normalize(torch.randn(B, T * n, H, K, device=device), dim=-1).to(dtype))
    v = leaf(torch.randn(B, T * n, H, V, device=device).to(dtype))
    beta = leaf(torch.rand(B, T * n, H, device=device).to(dtype))
    g = leaf(F.logsigmoid(torch.randn(B, T, H, device=device) + 3)) if gate else None
    return q, k, v, beta, g


def _ours(n, gate):
    from kernels.delta import delta_product

    def run(q, k, v, beta, g):
        return delta_product(q, k, v, beta, g=g if gate else None, num_householder=n, backend="triton")
    return run


def _fla(gate):
    if gate:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        def run(q, k, v, beta, g):
            return chunk_gated_delta_rule(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, output_final_state=True)
    else:
        from fla.ops.delta_rule import chunk_delta_rule

        def run(q, k, v, beta, g):
            return chunk_delta_rule(q, k, v, beta, scale=q.shape[-1] ** -0.5, output_final_state=True)
    return run


def _stand_in(gate):
    """The dry run's comparator (no fla kernels on a CPU): our chunked PyTorch path."""
    from kernels.delta import delta_product

    def run(q, k, v, beta, g):
        return delta_product(q, k, v, beta, g=g if gate else None, backend="torch")
    return run


def _time(run, args, backward: bool, device, warmup: int, reps: int) -> tuple[float, float]:
    """``(first call ms, median ms of reps after warmup)`` of ``run(*args)`` (and its backward)."""
    import torch

    from zoo.benchmark.measure import times_ms

    leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]

    def call():
        for a in leaves:
            a.grad = None
        if not backward:
            with torch.no_grad():
                run(*args)
            return
        o, s = run(*args)
        torch.autograd.backward([o, s], [torch.ones_like(o), torch.ones_like(s)])

    first = times_ms(call, device, 0, 1)[0]
    return first, statistics.median(times_ms(call, device, max(0, warmup - 1), reps))


def measure_delta(lengths=None, num_householder=(1, 2), B: int = 1, H: int = 8, K: int = 128,
                  V: int = 128, dtype: str = "bf16", warmup: int = 3, reps: int = 10, dry_run: bool = False) -> dict:
    """Time ours against fla (see the module docstring); returns the dict the script prints.

    ``lengths`` defaults to (16384, 65536), or (32, 64) in a dry run. ``dry_run``: toy sizes on the CPU
    through the Triton interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are imported),
    fp16, our chunked PyTorch path in fla's place.
    """
    import torch

    from kernels.backend import triton_interpreting

    cuda = torch.cuda.is_available() and not dry_run
    if dry_run:
        if not triton_interpreting() and not torch.cuda.is_available():
            raise RuntimeError("measure_delta(dry_run=True) on a CPU needs TRITON_INTERPRET=1 set before the "
                               "kernels are imported; run scripts/gpu_delta_check.py --dry-run")
        lengths = lengths or (32, 64)
        B, H, K, V, dtype, warmup, reps = 1, 1, 16, 16, "fp16", 1, 1
    elif not cuda:
        raise RuntimeError("measure_delta needs a CUDA device (or dry_run=True)")
    lengths = lengths or (16384, 65536)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    device = "cuda" if cuda else "cpu"
    comparator = "torch chunked (dry-run stand-in for fla)" if dry_run else "fla"
    times: dict = {"ours": {}, comparator: {}}
    first_call: dict = {}
    errors: dict = {}
    for T in lengths:
        for gate in (False, True):
            rule = "gated_delta_rule" if gate else "delta_rule"
            theirs = _stand_in(gate) if dry_run else _fla(gate)
            for name, run, n in [(comparator, theirs, 1)] + [("ours", _ours(n, gate), n) for n in num_householder]:
                key = f"{rule} n_h={n}" if name == "ours" else rule
                entry = times[name].setdefault(key, {}).setdefault(str(T), {})
                for backward in (False, True):
                    torch.manual_seed(0)
                    args = _inputs(B, T, H, K, V, n, gate, dt, device, grad=backward)
                    try:
                        first, ms = _time(run, args, backward, torch.device(device), warmup, reps)
                    except Exception as e:  # noqa: BLE001 - e.g. fla refusing its gated backward: report, go on
                        if name == "ours":
                            raise
                        errors[f"{name} {key} {T} {'fwd_bwd' if backward else 'fwd'}"] = f"{type(e).__name__}: {e}"[:300]
                        continue
                    finally:
                        del args
                    entry["fwd_bwd" if backward else "fwd"] = round(ms, 4)
                    first_call.setdefault(name, {}).setdefault(key, {})[f"{T} {'fwd_bwd' if backward else 'fwd'}"] = \
                        round(first / 1e3, 3)
                if cuda:
                    torch.cuda.empty_cache()
    vs_fla, n2_vs_n1 = {}, {}
    for rule in ("delta_rule", "gated_delta_rule"):
        for T in map(str, lengths):
            ours1 = times["ours"][f"{rule} n_h=1"][T]
            theirs = times[comparator][rule][T]
            vs_fla.setdefault(rule, {})[T] = {p: round(ours1[p] / theirs[p], 3) if p in theirs else None
                                              for p in ("fwd", "fwd_bwd")}
            if 2 in num_householder:
                ours2 = times["ours"][f"{rule} n_h=2"][T]
                n2_vs_n1.setdefault(rule, {})[T] = {p: round(ours2[p] / ours1[p], 3) for p in ("fwd", "fwd_bwd")}
    meets = {   # over the ratios measured (a comparison fla refused is listed in "errors", not counted)
        f"kernel_vs_fla <= {MAX_VS_FLA}": all(r <= MAX_VS_FLA for per_t in vs_fla.values() for rs in per_t.values()
                                             for r in rs.values() if r is not None),
        f"n2_vs_n1 <= {MAX_N2_VS_N1}": all(r <= MAX_N2_VS_N1 for per_t in n2_vs_n1.values()
                                          for rs in per_t.values() for r in rs.values()),
    }
    return {
        "card": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "commit": _commit(),
        "dtype": dtype, "B": B, "H": H, "K": K, "V": V, "warmup": warmup, "reps": reps,
        "comparator": comparator,
        "times_ms": times,
        "kernel_vs_fla": {rule: {T: r["fwd_bwd"] for T, r in per_t.items()} for rule, per_t in vs_fla.items()},
        "kernel_vs_fla_fwd_and_fwd_bwd": vs_fla,
        "deltaproduct_n2_vs_n1": n2_vs_n1,
        "first_call_s": first_call,
        "meets": meets,
        "errors": errors,
    }


def _commit() -> str:
    import subprocess
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (Triton interpreter), no fla")
    p.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 16384 65536; 32 64 dry)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", metavar="FILE", help="also write the result to FILE")
    args = p.parse_args(argv)
    if args.dry_run:
        import torch
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported
    result = measure_delta(lengths=tuple(args.lengths or ()) or None, reps=args.reps, dry_run=args.dry_run)
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0 if args.dry_run or all(result["meets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
