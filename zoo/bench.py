"""``zoo bench``: time sequence mixers against each other at growing context lengths.

For every chosen mixer and every sequence length ``T`` it measures, after warm-up:

- ``fwd_ms``: median time of an inference forward (``torch.no_grad``) of a ``(batch, T, d_model)`` input;
- ``fwd_bwd_ms``: median time of a training step's mixer part (forward with autograd, then backward);
- ``tok_s_fwd`` / ``tok_s_train``: ``batch * T`` divided by those times;
- ``peak_mib``: on CUDA, ``torch.cuda.max_memory_allocated`` during one forward+backward minus what
  was allocated before it (the mixer's working memory); on a CPU there is no allocator high-water mark
  worth reporting (the process's max RSS only ever grows), so it is ``null`` / "n/a";
- ``saved_mib``: bytes of the tensors autograd saves for the backward in one forward (parameters
  excluded, shared storages counted once), measured with ``saved_tensors_hooks`` — the same on every
  device, and the number that decides whether training at length ``T`` fits;
- ``decode_ms``: after ``mixer.prefill`` of a context of length ``T``, the median time of one
  ``mixer.step`` for the next token;
- ``state_bytes``: ``sum(numel * element_size)`` over the state dict returned by the prefill (attention's
  KV cache grows linearly with ``T``; the recurrent mixers' states do not), next to the mixer's own
  ``state_size(T)`` (elements) as a cross-check.

Timing uses CUDA events (with a synchronize) on a GPU and ``time.perf_counter`` on a CPU. A mixer that
raises or runs out of memory at some ``T`` gets its error recorded in that row and the sweep goes on;
``bench.json`` is rewritten after every row, so an interrupted run keeps everything it finished.

Outputs in ``--out``: ``bench.json`` (machine info, the configuration and every row), ``bench.md``
(a table where each mixer's times are also given as a ratio to attention measured in the same run,
when attention is in the run: the first attention entry, so ``--mixers attention:triton,attention:flash_attn``
compares two attention kernels) and ``bench.png`` (log-log forward+backward time and decode-state bytes
against ``T``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIMES = ("fwd_ms", "fwd_bwd_ms", "decode_ms")


# --------------------------------------------------------------------------- command line
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one mixer name")
    return names


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``zoo bench`` arguments to ``parser``."""
    parser.description = "Time mixers at growing context lengths: forward, forward+backward, memory, decode."
    parser.add_argument("--mixers", type=_name_list, default=["attention", "mamba2"],
                        help="comma-separated mixer names (see `zoo list`), each optionally with a backend, "
                             "e.g. attention:triton,attention:flash_attn,mamba2; default attention,mamba2")
    parser.add_argument("--backends", default="",
                        help="kernel backend: one value for every mixer that has a `backend` option "
                             "(e.g. triton), or per mixer: attention=flash_attn,mamba2=triton")
    parser.add_argument("--opt", action="append", default=[], metavar="MIXER.KEY=VALUE",
                        help="a mixer option, e.g. --opt mamba2.d_state=128 (repeatable; VALUE parsed as YAML)")
    parser.add_argument("--seq-lens", type=_int_list, default=[256, 1024, 4096],
                        help="comma-separated context lengths T; default 256,1024,4096")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="fp32 (default on CPU) or bf16 (default on CUDA) or fp16")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:i]")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for the run (default: torch's own choice); on a CPU shared with "
                             "other work, 1 avoids thread-barrier stalls that dwarf small kernels")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement (median; default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode-step timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixers' weights and inputs")
    parser.add_argument("--out", default="results/bench", help="output folder (default results/bench)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parse_backends(text: str, names: list[str]) -> dict[str, str]:
    if not text:
        return {}
    if "=" not in text:
        return {name: text.strip() for name in names}
    out = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"--backends: expected MIXER=BACKEND, got {part!r}")
        name, backend = (s.strip() for s in part.split("=", 1))
        if name not in names:
            raise ValueError(f"--backends: mixer {name!r} is not in --mixers ({', '.join(names)})")
        out[name] = backend
    return out


def _mixer_options(args, name: str, backends: dict[str, str]) -> dict:
    import yaml

    from mixers import MIXERS

    options: dict = {}
    fields = {f.name for f in dataclasses.fields(MIXERS.get(name).Options)}
    if name in backends and "backend" in fields:
        options["backend"] = backends[name]
    for text in args.opt:
        key, sep, value = text.partition("=")
        mixer, dot, field = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"--opt: expected MIXER.KEY=VALUE, got {text!r}")
        if mixer == name:
            options[field] = yaml.safe_load(value)
    return options


# --------------------------------------------------------------------------- measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _sync(device)
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
    return statistics.median(times)


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


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(err).lower()


def _error_text(err: BaseException) -> str:
    kind = "OOM" if _is_oom(err) else type(err).__name__
    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{kind}: {msg[:300]}"


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(mixer, T: int, batch: int, device: torch.device, dtype: torch.dtype, warmup: int, repeats: int,
            decode: bool = True) -> dict:
    """All the numbers of one (mixer, T) row. Each group of measurements fails on its own: an error in
    the backward still keeps the forward time."""
    row: dict = {}
    errors = []
    x = torch.randn(batch, T, mixer.d_model, device=device, dtype=dtype)
    n_tok = batch * T

    def attempt(what, fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a benchmark records every failure and goes on
            errors.append(f"{what}: {_error_text(err)}")
            _free(device)

    def fwd():
        with torch.no_grad():
            mixer(x)

    def do_fwd():
        row["fwd_ms"] = _median_ms(fwd, device, warmup, repeats)
        row["tok_s_fwd"] = n_tok / (row["fwd_ms"] / 1e3)

    xg = x.detach().clone().requires_grad_()
    grad_out = torch.randn_like(x)

    def fwd_bwd():
        xg.grad = None
        mixer(xg).backward(grad_out)

    def do_fwd_bwd():
        row["fwd_bwd_ms"] = _median_ms(fwd_bwd, device, warmup, repeats)
        row["tok_s_train"] = n_tok / (row["fwd_bwd_ms"] / 1e3)
        mixer.zero_grad(set_to_none=True)

    def do_memory():
        row["saved_mib"] = _saved_bytes(mixer, xg) / 2**20
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fwd_bwd()
            _sync(device)
            row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            mixer.zero_grad(set_to_none=True)
        else:
            row["peak_mib"] = None  # no honest allocator high-water mark on a CPU

    def do_decode():
        with torch.no_grad():
            _, state = mixer.prefill(x)
            row["state_bytes"] = _state_bytes(state)
            x_t = torch.randn(batch, mixer.d_model, device=device, dtype=dtype)
            row["decode_ms"] = _median_ms(lambda: mixer.step(x_t, state), device, warmup, repeats)
        try:
            row["state_size"] = mixer.state_size(T)
        except NotImplementedError:
            row["state_size"] = None

    attempt("forward", do_fwd)
    attempt("forward+backward", do_fwd_bwd)
    attempt("memory", do_memory)
    if decode:
        attempt("decode", do_decode)
    row["error"] = "; ".join(errors) if errors else None
    return row


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def machine_info(device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    from importlib import metadata

    for key, dists in (("flash_attn", ("flash-attn", "flash_attn")), ("mamba_ssm", ("mamba-ssm", "mamba_ssm")),
                       ("fla", ("flash-linear-attention", "fla-core"))):
        info[key] = None
        for dist in dists:  # versions from the installed metadata: importing them is slow and noisy
            try:
                info[key] = f"{dist} {metadata.version(dist)}"
                break
            except metadata.PackageNotFoundError:
                pass
    return info


# --------------------------------------------------------------------------- rendering
def _fmt(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.{digits}g}" if abs(value) < 100 else f"{value:.0f}"
        return f"{value:.2e}"
    return str(value)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Add ``<time>_vs_attention`` to every row whose T also has a successful attention row."""
    labels = [r["label"] for r in rows if r["mixer"] == "attention"]
    base = labels[0] if labels else None  # the first attention entry of the run is the baseline
    attn = {r["T"]: r for r in rows if r["label"] == base}
    out = []
    for r in rows:
        r = dict(r)
        a = attn.get(r["T"])
        for key in TIMES:
            if a is not None and r.get(key) is not None and a.get(key):
                r[f"{key}_vs_attention"] = r[key] / a[key]
        out.append(r)
    return out


def render_markdown(result: dict) -> str:
    from tabulate import tabulate

    rows = with_ratios(result["rows"])
    has_attn = any(r["mixer"] == "attention" for r in rows)
    m, c = result["machine"], result["config"]
    headers = ["mixer", "backend", "T", "fwd ms", "fwd+bwd ms"]
    if has_attn:
        headers += ["fwd+bwd / attn"]
    headers += ["train tok/s", "peak MiB", "saved MiB", "decode ms"]
    if has_attn:
        headers += ["decode / attn"]
    headers += ["state KiB", "error"]
    table = []
    for r in rows:
        line = [r["label"], r.get("backend") or "", r["T"], _fmt(r.get("fwd_ms")), _fmt(r.get("fwd_bwd_ms"))]
        if has_attn:
            line.append(_fmt(r.get("fwd_bwd_ms_vs_attention"), 3))
        line += [_fmt(r.get("tok_s_train")), _fmt(r.get("peak_mib")), _fmt(r.get("saved_mib")), _fmt(r.get("decode_ms"))]
        if has_attn:
            line.append(_fmt(r.get("decode_ms_vs_attention"), 3))
        sb = r.get("state_bytes")
        line += [_fmt(sb / 1024 if sb is not None else None), r.get("error") or ""]
        table.append(line)
    head = (f"# zoo bench\n\n"
            f"Device: {m['device_name']} ({m['device']}), torch {m['torch']}, {m['threads']} threads; "
            f"batch {c['batch']}, d_model {c['d_model']}, {c['dtype']}, median of {c['repeats']} after "
            f"{c['warmup']} warm-up.\n"
            f"fwd = inference forward (no_grad); fwd+bwd = forward with autograd + backward; "
            f"decode = one step after a prefill of T tokens; state = decode state after that prefill; "
            f"saved = tensors kept for the backward; peak = CUDA high-water mark (n/a on CPU)"
            + ("; `/ attn` = ratio to the first attention entry at the same T in this run" if has_attn else "") + ".\n\n")
    return head + tabulate(table, headers=headers, tablefmt="github") + "\n"


def render_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(dict.fromkeys(r["label"] for r in result["rows"]))
    for name in names:
        rows = sorted((r for r in result["rows"] if r["label"] == name), key=lambda r: r["T"])
        pts = [(r["T"], r["fwd_bwd_ms"]) for r in rows if r.get("fwd_bwd_ms")]
        if pts:
            ax_t.plot(*zip(*pts), marker="o", label=name)
        pts = [(r["T"], r["state_bytes"]) for r in rows if r.get("state_bytes")]
        if pts:
            ax_s.plot(*zip(*pts), marker="o", label=name)
    c = result["config"]
    for ax, title, ylabel in ((ax_t, "forward + backward", "time (ms)"), (ax_s, "decode state after prefill", "bytes")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(f"{result['machine']['device_name']}, batch {c['batch']}, d_model {c['d_model']}, {c['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_json(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the command
def _entries(args) -> list[tuple[str, str, dict]]:
    """``(label, mixer name, options)`` for every ``--mixers`` entry (``name`` or ``name:backend``)."""
    from mixers import MIXERS

    names = [spec.partition(":")[0] for spec in args.mixers]
    for name in names:
        MIXERS.get(name, "--mixers")
    backends = _parse_backends(args.backends, list(dict.fromkeys(names)))
    entries, labels = [], set()
    for spec in args.mixers:
        name, _, backend = spec.partition(":")
        options = _mixer_options(args, name, backends)
        if backend:
            if "backend" not in {f.name for f in dataclasses.fields(MIXERS.get(name).Options)}:
                raise ValueError(f"--mixers {spec}: mixer {name!r} has no backend option")
            options["backend"] = backend
        label = f"{name}:{options['backend']}" if (backend or name in backends) else name
        if label in labels:
            raise ValueError(f"--mixers: {label!r} is listed twice")
        labels.add(label)
        entries.append((label, name, options))
    return entries


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (from :func:`configure_parser`); returns an exit code."""
    try:
        entries = _entries(args)
        if args.batch <= 0 or args.d_model <= 0 or args.repeats <= 0 or args.warmup < 0:
            raise ValueError("--batch, --d-model and --repeats must be positive, --warmup >= 0")
        if args.threads is not None and args.threads <= 0:
            raise ValueError("--threads must be positive")
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                              else ("cpu" if args.device == "auto" else args.device))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
    except (ValueError, RuntimeError) as err:  # includes mixers' OptionError and bad device strings
        print(f"zoo bench: error: {err}", file=sys.stderr)
        return 2
    previous_threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, device, entries)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args, device, entries) -> int:
    import mixers

    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine_info(device),
        "config": {"mixers": args.mixers, "options": {label: opts for label, _, opts in entries},
                   "seq_lens": args.seq_lens, "batch": args.batch, "d_model": args.d_model, "dtype": dtype_name,
                   "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed, "decode": not args.no_decode,
                   "threads": torch.get_num_threads()},
        "rows": [],
    }
    json_path = out / "bench.json"
    from tqdm import tqdm

    jobs = [(entry, T) for entry in entries for T in args.seq_lens]
    bar = tqdm(jobs, desc="bench", disable=args.no_progress, file=sys.stderr)
    built: dict[str, object] = {}
    build_errors: dict[str, Exception] = {}
    for (label, name, options), T in bar:
        bar.set_postfix_str(f"{label} T={T}")
        row = {"mixer": name, "label": label, "T": T, "batch": args.batch, "d_model": args.d_model,
               "dtype": dtype_name, "device": str(device), "backend": options.get("backend")}
        t0 = time.perf_counter()
        try:
            if label in build_errors:
                raise build_errors[label]
            if label not in built:
                torch.manual_seed(args.seed)
                try:
                    mixer = mixers.build_mixer(name, args.d_model, options, path=f"--mixers {label}")
                    built[label] = mixer.to(device=device, dtype=dtype)
                except Exception as err:
                    build_errors[label] = err
                    raise
            mixer = built[label]
            row["params"] = sum(p.numel() for p in mixer.parameters())
            if row["backend"] is None and hasattr(mixer.options, "backend"):
                row["backend"] = mixer.options.backend
            torch.manual_seed(args.seed + T)
            row.update(measure(mixer, T, args.batch, device, dtype, args.warmup, args.repeats, not args.no_decode))
        except Exception as err:  # noqa: BLE001 - building failed: record it, go on
            row["error"] = f"build: {_error_text(err)}"
            _free(device)
        row["wall_s"] = time.perf_counter() - t0
        result["rows"].append(row)
        _write_json(json_path, result)  # every finished row is on disk at once
        if row.get("error"):
            tqdm.write(f"zoo bench: {label} T={T}: {row['error']}", file=sys.stderr)
    (out / "bench.md").write_text(render_markdown(result))
    if not args.no_plot:
        render_plot(result, out / "bench.png")
    print(render_markdown(result))
    print(f"wrote {json_path}, {out / 'bench.md'}" + ("" if args.no_plot else f", {out / 'bench.png'}"))
    ok = [r for r in result["rows"] if r.get("fwd_ms") is not None or r.get("fwd_bwd_ms") is not None]
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.bench")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
