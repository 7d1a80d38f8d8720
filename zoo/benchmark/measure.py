"""Measuring one mixer at one sequence length: forward, forward+backward, saved memory, decode.

- ``fwd_ms``: median time of an inference forward (``torch.no_grad``) of a ``(batch, T, d_model)`` input;
  every timing's individual repetitions are kept in ``<name>_samples`` (so that :func:`merge_samples`
  can pool the repetitions of several rounds of a sweep into one median);
- ``fwd_bwd_ms``: median time of a training step's mixer part (forward with autograd, then backward);
- ``tok_s_fwd`` / ``tok_s_train``: ``batch * T`` divided by those times;
- ``fwd_user_ms`` / ``fwd_sys_ms`` (and ``fwd_bwd_*``, ``decode_*``; totals in ``<name>_cpu``): CPU time
  per call of each timing (``getrusage`` of the process around the timed repetitions, so on a CPU it counts
  every torch thread), user and system (kernel: page faults, memory mapping) apart; on a shared machine CPU
  time is steadier than wall time, and system time shows memory management that arithmetic does not explain;
- ``peak_mib``: the working memory of one forward+backward: on CUDA ``torch.cuda.max_memory_allocated``
  minus what was allocated before it; on a CPU the peak resident set size minus the resident size before
  it (:class:`zoo.host_memory.PeakRSS`: free heap memory returned first, the kernel's high-water mark
  reset; ``None`` where that reset is unavailable);
- ``prefill_peak_mib``: the same for one ``mixer.prefill`` of the ``T`` tokens without autograd (measured
  just before the forward+backward's, which reuses the heap memory the prefill left free);
- ``saved_mib``: bytes of the tensors autograd saves for the backward in one forward (parameters
  excluded, shared storages counted once), measured with ``saved_tensors_hooks`` — the same on every
  device, and the number that decides whether training at length ``T`` fits;
- ``decode_ms``: after ``mixer.prefill`` of a context of length ``T``, the median time of one
  ``mixer.step`` for the next token;
- ``state_bytes``: ``sum(numel * element_size)`` over the state dict returned by the prefill (the whole
  batch), next to the mixer's own ``state_size(T)`` and ``active_state_size(T)`` (elements per sequence);
  ``state_elements``: the elements per sequence of that state, which must equal ``state_size(T)`` (the count
  results tables report): :func:`state_size_note` words a difference, which ``zoo bench`` notes in the row.

Timing uses CUDA events (with a synchronize) on a GPU and ``time.perf_counter`` on a CPU, after warm-up.
Each group of measurements fails on its own: an error in the backward still keeps the forward time.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from ..host_memory import PeakRSS, cpu_seconds


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def times_ms(fn, device: torch.device, warmup: int, repeats: int, cpu: list | None = None) -> list[float]:
    """Wall times (ms) of ``repeats`` calls after ``warmup``; appends ``(user s, system s, calls)`` of the
    timed calls to ``cpu`` if given."""
    for _ in range(warmup):
        fn()
    times = []
    user0, sys0 = cpu_seconds()
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sync(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if cpu is not None:
        user1, sys1 = cpu_seconds()
        cpu.append((user1 - user0, sys1 - sys0, repeats))
    return times


TIMES = ("fwd_ms", "fwd_bwd_ms", "decode_ms")


def _set_time(row: dict, name: str, samples: list[float], cpu: list | None = None) -> None:
    row[name + "_samples"] = samples
    row[name] = statistics.median(samples)
    if cpu:
        stem = name.removesuffix("_ms")                                 # fwd_ms -> fwd_cpu, fwd_user_ms, ...
        row[stem + "_cpu"] = [sum(c[i] for c in cpu) for i in range(3)]   # user s, system s, calls
        user, system, calls = row[stem + "_cpu"]
        row[stem + "_user_ms"] = user / calls * 1e3
        row[stem + "_sys_ms"] = system / calls * 1e3


def merge_samples(row: dict, again: dict) -> None:
    """Pool the timing repetitions of ``again`` (a later measurement of the same mixer and ``T``) into
    ``row`` and recompute its medians and throughputs."""
    for name in TIMES:
        if again.get(name + "_samples") and row.get(name + "_samples") is not None:
            stem = name.removesuffix("_ms")
            cpu = [c for c in (row.get(stem + "_cpu"), again.get(stem + "_cpu")) if c]
            _set_time(row, name, row[name + "_samples"] + again[name + "_samples"], cpu)
    n_tok = row["batch"] * row["T"] if "batch" in row else None
    if n_tok:
        if row.get("fwd_ms"):
            row["tok_s_fwd"] = n_tok / (row["fwd_ms"] / 1e3)
        if row.get("fwd_bwd_ms"):
            row["tok_s_train"] = n_tok / (row["fwd_bwd_ms"] / 1e3)


def _saved_bytes(mixer, x) -> int:
    """Bytes autograd keeps for the backward of one forward (parameters excluded, storages once)."""
    params = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mixer(x)
    del y
    return sum(storages.values())


def _state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _state_elements(state, batch: int) -> int:
    """Elements per sequence of a state (the count ``state_size`` claims)."""
    return sum(t.numel() for t in state.values()) // batch


def state_size_note(row: dict) -> str | None:
    """None when a measured row's ``state_size`` is the elements per sequence of the state its prefill returned
    (or either is missing); else the line ``zoo bench`` notes in the row."""
    claimed, held = row.get("state_size"), row.get("state_elements")
    if claimed is None or held is None or claimed == held:
        return None
    return (f"state: state_size({row['T']}) = {claimed} elements per sequence, but the state prefill returns holds "
            f"{held} (state KiB shows those): make state_size count the state step carries, which results tables "
            f"report")


def largest_difference(ours: list, reference: list) -> float:
    """The largest over tensor pairs of ``max |a - b| / max |b|``: how far two runs of one computation (other
    kernel schedules, say) are apart, relative to each output's scale."""
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
               for a, b in zip(ours, reference))


def is_oom(err: BaseException) -> bool:
    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(err).lower()


def error_text(err: BaseException) -> str:
    kind = "OOM" if is_oom(err) else type(err).__name__
    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{kind}: {msg[:300]}"


def free(device: torch.device) -> None:

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_mibs(fns, device: torch.device) -> list[float | None]:
    """Working memory of each ``fn()`` in MiB, run in order: the CUDA allocator's high-water mark above what
    was allocated before it, or on a CPU the peak resident set size above the resident size before the
    first (:class:`zoo.host_memory.PeakRSS`; the later ones reuse the heap memory the earlier ones left
    free, so list the pieces of work by growing need); ``None`` where the kernel's high-water mark cannot
    be reset."""
    free(device)
    out: list[float | None] = []
    if device.type == "cuda":
        for fn in fns:
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn()
            sync(device)
            out.append((torch.cuda.max_memory_allocated(device) - base) / 2**20)
        return out
    first = None
    for fn in fns:
        with PeakRSS(after=first) as peak:
            fn()
        first = first or peak
        out.append(peak.mib)
    return out


def measure(mixer, T: int, batch: int, device: torch.device, dtype: torch.dtype, warmup: int, repeats: int,
            decode: bool = True, memory: bool = True) -> dict:
    """All the numbers of one (mixer, T) row. Each group of measurements fails on its own: an error in
    the backward still keeps the forward time. ``memory=False`` skips the (untimed) memory measurement,
    for a repeated round whose memory numbers are already known."""
    row: dict = {}
    errors = []
    x = torch.randn(batch, T, mixer.d_model, device=device, dtype=dtype)
    n_tok = batch * T

    def attempt(what, fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a benchmark records every failure and goes on
            errors.append(f"{what}: {error_text(err)}")
            free(device)

    def fwd():
        with torch.no_grad():
            mixer(x)

    def do_fwd():
        cpu: list = []
        _set_time(row, "fwd_ms", times_ms(fwd, device, warmup, repeats, cpu), cpu)
        row["tok_s_fwd"] = n_tok / (row["fwd_ms"] / 1e3)

    xg = x.detach().clone().requires_grad_()
    grad_out = torch.randn_like(x)

    def fwd_bwd():
        xg.grad = None
        mixer(xg).backward(grad_out)

    def do_fwd_bwd():
        cpu: list = []
        _set_time(row, "fwd_bwd_ms", times_ms(fwd_bwd, device, warmup, repeats, cpu), cpu)
        row["tok_s_train"] = n_tok / (row["fwd_bwd_ms"] / 1e3)
        mixer.zero_grad(set_to_none=True)

    def do_memory():
        # the timed calls left the input's gradient allocated; the measured call frees it as it starts, so a base
        # taken with it would leave one input-sized buffer (the gradient the backward writes) out of the peak
        xg.grad = None
        row["saved_mib"] = _saved_bytes(mixer, xg) / 2**20

        def prefill():
            with torch.no_grad():
                mixer.prefill(x)

        # the prefill first: the forward+backward then reuses the heap memory it left free (on a CPU one
        # release of free memory and one fault-in per row instead of two)
        row["prefill_peak_mib"], row["peak_mib"] = peak_mibs([prefill, fwd_bwd], device)
        mixer.zero_grad(set_to_none=True)
        xg.grad = None

    def do_decode():
        with torch.no_grad():
            _, state = mixer.prefill(x)
            row["state_bytes"] = _state_bytes(state)
            x_t = torch.randn(batch, mixer.d_model, device=device, dtype=dtype)
            cpu: list = []
            _set_time(row, "decode_ms", times_ms(lambda: mixer.step(x_t, state), device, warmup, repeats, cpu), cpu)
        row["state_size"] = mixer.state_size(T)
        row["active_state_size"] = mixer.active_state_size(T)
        row["state_elements"] = _state_elements(state, batch)

    attempt("forward", do_fwd)
    attempt("forward+backward", do_fwd_bwd)
    if memory:
        attempt("memory", do_memory)
    if decode:
        attempt("decode", do_decode)
    row["error"] = "; ".join(errors) if errors else None
    return row
