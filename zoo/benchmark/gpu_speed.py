"""One command for the zoo's GPU speed targets, ours next to flash-linear-attention and SDPA in one run.

``python -m zoo.benchmark.gpu_speed`` (``scripts/gpu_speed.sh``) runs, on one CUDA GPU in bf16, within
``--budget`` seconds (default 420: with start-up and the wheels' install, one H100 or H200 command of at
most 8 minutes), these stages, each in a process of its own (forked; the parent never touches CUDA) under
its own time limit, each rewriting its JSON file after every measurement so that a stage or a run killed
at its limit keeps what it measured:

1. ``env``: the device, versions and commit;
2. ``first_call``: every mixer's layer, its first forward+backward at ``T = 16384``, in a fresh process
   with an empty Triton cache (``TRITON_CACHE_DIR``), compilation included, two processes at a time: the
   layer's kernels compiled ahead on half the cores (:func:`kernels.ahead.forward_backward_ahead`, as
   ``zoo train`` compiles a step's before its first), then the call (the card runs it in milliseconds; a
   time measured beside another process's compiles is, if anything, long); ``seconds`` is both,
   ``ahead_seconds`` the first, split into ``ahead_run_seconds`` (the dry call submitting its kernels),
   ``ahead_wait_seconds`` (then waiting for the compiles) and ``ahead_load_seconds`` (loading them onto the
   device); each cache is then merged into the run's shared one, so later stages do not compile the same
   kernels again;
3. ``kernel``: our gated delta rule (one Householder step) and DeltaProduct (two), forward and
   forward+backward, ``B 1, H 8, K = V = 128``, ``T = 16384, 65536`` (:func:`time_delta`), and where one
   forward+backward's device time goes, kernel by kernel (:mod:`zoo.benchmark.device_time`);
4. ``layers``: every mixer's layer (``d_model 1024``, head dim 128, batch 1, our backend: Triton where
   the family has it, else the chunked PyTorch path) next to an SDPA attention layer at the same lengths
   (:func:`zoo.benchmark.measure.measure`), the device kernels one forward+backward launches
   (``torch.profiler`` on CUDA) and their device time by kernel; then the same forward+backward captured once
   as a CUDA graph and replayed (:func:`layer_graph`: ``graph_fwd_bwd_ms``, and the first replay's gaps to an
   eager call, ``graph_output_gap`` and ``graph_grad_gap``; or ``graph_error``), the layer's time with the host
   out of it, as in a language model trained with ``train.cuda_graph``;
5. ``lm``: four-layer language models (``d_model 512``) of every linear-state mixer and of attention,
   steady-state training tokens/s at ``T = 2048`` (batch 8) and ``T = 8192`` (batch 2, the same tokens per
   step), timed over steps 20-70 (:mod:`zoo.benchmark.train_rate`; a slow model is timed over fewer steps
   within its share of the stage's time, and the row says how many), each model's kernels compiled ahead
   first (``ahead_seconds``), as ``zoo train`` does; then one more step's device kernels (``step_launches``,
   ``step_device_ms``, the longest by name in ``step_kernels``) and the host's time to issue it
   (``step_host_ms``, ``step_syncs``): a step whose host time exceeds its device time is launch-bound, its
   tokens/s set by Python, autograd and the launchers;
   then the same model trains on with each step's forward and backward captured once as a CUDA graph and
   replayed (``train.cuda_graph``, :mod:`zoo.training.captured`): ``graph_tokens_per_second`` and its steps,
   or ``graph_error`` where the capture failed, and how far the first replay's loss and gradients are from an
   eager step's on the same weights (``graph_loss_gap``, ``graph_grad_gap``: largest difference relative to
   the largest magnitude; 0 where they agree to the bit). Each mode gets half the row's time;
6. ``fla``: flash-linear-attention's ``chunk_delta_rule`` on the kernel stage's inputs (with its kernels'
   device times, beside ours), last and under the
   time left (it autotunes for 30-90 s per shape at its first call; ``FLA_CACHE_RESULTS=1`` and the shared
   Triton cache keep its autotuning within the run). Its gated backward is refused on Hopper GPUs with
   Triton < 3.7.1, so the ungated rule is the comparison for forward and backward alike.

Outputs in ``<parent>/bench-gpu-<card>/`` (``parent``: ``--out``, else ``$OUT`` where set, else
``tables``): the six stage files ``env.json``, ``first_call.json``, ``kernel.json``, ``layers.json``,
``lm.json``, ``fla.json``, then ``summary.json`` (the ratios, in the form :mod:`zoo.benchmark.gpu_targets`
documents) and ``summary.md`` (every target with its value and verdict, and the stages' numbers), both
built from the stage files (:mod:`zoo.benchmark.gpu_report`). Exit
status: 0 every target measured and met, 1 a target missed, 3 none missed but some not measured, 2 no
CUDA device (or bad arguments).

``--dry-run`` runs the same pipeline at toy sizes on the CPU (fp32, the chunked PyTorch backends, our
chunked delta rule standing in for flash-linear-attention, operators dispatched standing in for device
kernels) into a temporary folder unless ``--out`` is given; the test suite runs it. ``--check DIR`` gives
a finished folder's verdicts again, with the same exit status (for a run stopped before its summary, the
summary is built from its stage files first). ``--stages kernel,fla`` re-runs some stages into an
existing folder and keeps the others' files; each stage file records the run that wrote it (``run``), and
the kernel ratio, whose two sides are two stages, is only taken from a ``kernel.json`` and ``fla.json`` of
one run (else it is "not measured").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx.experimental.symbolic_shapes  # noqa: F401 - what a first backward imports: see run()
import torch.nn.functional as F

from kernels.ahead import available_cores, forward_backward_ahead
from kernels.backend import package_importable
from kernels.delta import delta_product
from mixers import MIXERS

from ..environment import environment
from ..errors import UserError
from ..model import HybridLM
from ..recipes import resolve
from ..training.captured import StepPasses, agreement
from ..training.optim import make_optimizer
from .device_time import Breakdown, breakdown, host_issue
from .gpu_report import check_folder, conclude, read_json
from .gpu_targets import BASELINE, STAGES
from .measure import error_text, free, measure, sync, times_ms
from .runner import write_json
from .train_rate import LMStep, steady_rate

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: kernels (by name, longest first) a language-model row keeps from its profiled step
STEP_KERNELS = 8


@dataclass(frozen=True)
class Plan:
    """Sizes and time limits of a run (:data:`FULL` on a GPU, :data:`DRY` for ``--dry-run``)."""

    device: str
    dtype: str
    kernel_lengths: tuple = (16384, 65536)
    kernel_heads: int = 8
    kernel_dim: int = 128
    layer_lengths: tuple = (16384, 65536)
    d_model: int = 1024
    head_dim: int = 128                       # n_heads = d_model / head_dim where a mixer has both options
    first_call_length: int = 16384
    lm_lengths: tuple = (2048, 8192)
    lm_tokens: int = 16384                    # tokens per step at every length: batch = lm_tokens / T
    lm_layers: int = 4
    lm_d_model: int = 512
    lm_vocab: int = 256
    lm_warmup: int = 20
    lm_steps: int = 50
    warmup: int = 2                           # untimed calls before each timing
    repeats: int = 5                          # timed calls (median)
    budget: float = 420.0                     # seconds for the whole run (8 minutes less start-up)
    stage_seconds: tuple = (("env", 60), ("first_call", 110), ("kernel", 45), ("layers", 110), ("lm", 150))
    first_call_seconds: float = 20.0          # one mixer's fresh process
    first_call_workers: int = 2               # fresh processes at a time (each compiles on its share of the cores)
    fla_seconds: float = 60.0                 # kept for the fla stage, which gets whatever is left

    def limit(self, stage: str) -> float:
        return dict(self.stage_seconds).get(stage, self.budget)


FULL = Plan("cuda", "bf16")
DRY = Plan("cpu", "fp32", kernel_lengths=(64, 256), kernel_heads=2, kernel_dim=16, layer_lengths=(64, 256),
           d_model=64, head_dim=16, first_call_length=64, lm_lengths=(32, 128), lm_tokens=256, lm_d_model=32,
           lm_layers=2, lm_vocab=64, lm_warmup=1, lm_steps=2, warmup=0, repeats=1, budget=400.0,
           stage_seconds=(("env", 60), ("first_call", 150), ("kernel", 60), ("layers", 90), ("lm", 90)),
           first_call_seconds=60.0, fla_seconds=30.0)


def mixer_names() -> tuple[list[str], list[str]]:
    """Every mixer the library defines (the baseline first; not one a test or a user module registered) and the
    linear-state ones (state constant in T)."""
    names = [BASELINE] + [n for n in MIXERS.builtin_names("mixers") if n != BASELINE]
    return names, [n for n in names if not MIXERS.get(n).state_grows_with_seq_len]


def our_backend(name: str, device: str) -> str:
    """The backend a layer is timed with: SDPA for the baseline; else our Triton kernels on CUDA where the
    family has them, the chunked PyTorch path otherwise (never another project's kernels)."""
    fields = {f.name: f for f in dataclasses.fields(MIXERS.get(name).Options)}
    choices = fields["backend"].metadata.get("choices", ()) if "backend" in fields else ()
    if name == BASELINE or not (device == "cuda" and "triton" in choices):
        return "torch"
    return "triton"


def layer_entry(name: str, plan: Plan, d_model: int, backend: str | None = None) -> dict:
    """The recipe entry of ``name``'s layer in this run: our backend (or ``backend``, where the mixer has one), and
    head dim ``plan.head_dim``."""
    fields = {f.name for f in dataclasses.fields(MIXERS.get(name).Options)}
    options = {"backend": backend or our_backend(name, plan.device)} if "backend" in fields else {}
    if {"n_heads", "head_dim"} <= fields:
        options["n_heads"] = max(1, d_model // plan.head_dim)
    return {name: options}


def build_layer(name: str, plan: Plan, device, dtype, backend: str | None = None):
    entry = layer_entry(name, plan, plan.d_model, backend)
    spec = resolve({"model": {"d_model": plan.d_model, "layers": [entry]}}).layers[0]
    torch.manual_seed(0)
    return MIXERS.get(name)(plan.d_model, spec.options).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------- launch counters
def _one_call(probe, mixer, T: int, device, dtype):
    """``probe(call, device)`` of one forward+backward of ``mixer`` at length ``T``, its gradients cleared after."""
    x = torch.randn(1, T, mixer.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    found = probe(lambda: mixer(x).backward(grad), device)
    mixer.zero_grad(set_to_none=True)
    return found


def layer_breakdown(mixer, T: int, device, dtype) -> Breakdown:
    """The kernels of one forward+backward of ``mixer`` at length ``T`` (:mod:`.device_time`)."""
    return _one_call(breakdown, mixer, T, device, dtype)


def layer_host(mixer, T: int, device, dtype) -> dict:
    """The host's side of one forward+backward of ``mixer`` at length ``T`` (:func:`.device_time.host_issue`)."""
    return _one_call(host_issue, mixer, T, device, dtype)


def layer_graph(mixer, T: int, device, dtype, warmup: int, repeats: int) -> dict:
    """One forward+backward of ``mixer`` at length ``T`` (the input's gradient too) captured once as a CUDA graph
    (:mod:`zoo.training.captured`) and replayed: ``graph_fwd_bwd_ms``, the median replay of ``repeats`` after
    ``warmup`` (the device's time: the host issues one launch), and how far the first replay's output and
    gradients are from an eager call's (``graph_output_gap``, ``graph_grad_gap``); ``graph_error`` where it
    cannot be captured."""
    if device.type != "cuda":
        return {"graph_error": "needs CUDA"}
    params = [p for p in mixer.parameters() if p.requires_grad]

    def passes(x, grad):
        leaf = x.detach().requires_grad_()
        y = mixer(leaf)
        y.backward(grad)
        return y.detach(), leaf.grad

    x = torch.randn(1, T, mixer.d_model, device=device, dtype=dtype)
    inputs = {"x": x, "grad": torch.randn_like(x)}
    graphed = StepPasses(passes, params, device, cuda_graph=True)
    try:
        agree = agreement(StepPasses(passes, params, device), graphed, inputs)
        if graphed.error is not None:
            return {"graph_error": graphed.error}
        replay = graphed.captured.graph.replay
        return {"graph_fwd_bwd_ms": statistics.median(times_ms(replay, device, warmup, repeats)),
                "graph_output_gap": agree["outputs"], "graph_grad_gap": agree["grads"]}
    finally:
        graphed.close()
        mixer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------- stages
def card_folder(card: str, device: str) -> str:
    """``bench-gpu-h100`` for "NVIDIA H100 80GB HBM3"; ``bench-gpu-cpu`` for a dry run."""
    if device != "cuda":
        return "bench-gpu-cpu"
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", card.upper())
    slug = model.group(1) if model else re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    return f"bench-gpu-{slug.lower()}"


def commit(env: dict) -> str:
    """``ZOO_COMMIT`` where set (a copy of the tree without its git history), else the checkout's commit,
    marked ``+dirty`` when tracked files differ from it."""
    if os.environ.get("ZOO_COMMIT"):
        return os.environ["ZOO_COMMIT"]
    found = env["versions"].get("git")
    if not found:
        return "unknown (no git checkout; set ZOO_COMMIT)"
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                            text=True, cwd=Path(__file__).parent, timeout=10).stdout
    return found + ("+dirty" if status.strip() else "")


def stage_env(plan: Plan, path: Path, deadline: float) -> None:
    device = torch.device(plan.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        write_json(path, {"error": "no CUDA device here; scripts/gpu_speed.sh --dry-run runs the pipeline on a CPU"})
        return
    env = environment(device)
    card = env["device_name"] if device.type == "cuda" else f"{env['device_name']} (dry run)"
    names, linear = mixer_names()
    write_json(path, {"card": card, "folder": card_folder(card, plan.device), "commit": commit(env),
                      "environment": env, "plan": dataclasses.asdict(plan), "mixers": names, "linear": linear})


def stage_first_call(plan: Plan, name: str, path: Path, deadline: float) -> None:
    device, dtype = torch.device(plan.device), DTYPES[plan.dtype]
    row = {"mixer": name, "backend": our_backend(name, plan.device), "T": plan.first_call_length}
    try:
        mixer = build_layer(name, plan, device, dtype)
        x = torch.randn(1, plan.first_call_length, plan.d_model, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        sync(device)
        start = time.perf_counter()
        ahead = forward_backward_ahead(mixer, x, workers=max(1, available_cores() // plan.first_call_workers))
        row.update(ahead_seconds=time.perf_counter() - start, kernels_ahead=ahead.compiled,
                   kernels_loaded=ahead.loaded, threads=ahead.workers, ahead_run_seconds=ahead.run_seconds,
                   ahead_wait_seconds=ahead.wait_seconds, ahead_load_seconds=ahead.load_seconds)
        if ahead.skipped:
            row["ahead_skipped"] = ahead.skipped
        mixer(x).backward(grad)
        sync(device)
        row["seconds"] = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = error_text(err)
    write_json(path, row)


def delta_inputs(plan: Plan, T: int, n_h: int, gated: bool, device, dtype):
    """Unit-norm keys and queries, ``beta`` in (0, 1), log decays below 0 (fp32); the same for any backend."""
    torch.manual_seed(T)
    H, K = plan.kernel_heads, plan.kernel_dim
    q = F.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T * n_h, H, K, device=device), dim=-1).to(dtype)
    v = torch.randn(1, T * n_h, H, K, device=device).to(dtype)
    beta = torch.rand(1, T * n_h, H, device=device).to(dtype)
    g = F.logsigmoid(torch.randn(1, T, H, device=device)) if gated else None
    return q, k, v, beta, g


def time_delta(plan: Plan, row: dict, save) -> None:
    """Forward and forward+backward ms of ``kernels.delta.delta_product`` for ``row`` (``T``, ``n_h``,
    ``gated``, ``backend``), filled into ``row``; ``save()`` after each."""
    device, dtype = torch.device(plan.device), DTYPES[plan.dtype]
    T, n_h = row["T"], row["n_h"]
    try:
        inputs = delta_inputs(plan, T, n_h, row["gated"], device, dtype)

        def call(*xs):
            return delta_product(*xs[:4], g=xs[4], num_householder=n_h, backend=row["backend"])[0]

        def fwd():
            with torch.no_grad():
                call(*inputs)

        row["fwd_ms"] = statistics.median(times_ms(fwd, device, plan.warmup, plan.repeats))
        save()
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        grad = torch.randn(1, T, plan.kernel_heads, plan.kernel_dim, device=device, dtype=dtype)

        def fwd_bwd():
            for t in leaves:
                if t is not None:
                    t.grad = None
            call(*leaves).backward(grad)

        row["fwd_bwd_ms"] = statistics.median(times_ms(fwd_bwd, device, plan.warmup, plan.repeats))
        save()
        row.update(breakdown(fwd_bwd, device).as_row())
    except Exception as err:  # noqa: BLE001
        row["error"] = error_text(err)
    free(device)
    save()


def _delta_stage(plan: Plan, path: Path, rows: list[dict], about: str) -> None:
    result = {"about": about, "rows": []}
    for row in rows:
        result["rows"].append(row)
        time_delta(plan, row, lambda: write_json(path, result))


def stage_kernel(plan: Plan, path: Path, deadline: float) -> None:
    backend = our_backend("gated_deltanet", plan.device)
    rows = [{"op": f"ours, n_h {n}, gated", "backend": backend, "n_h": n, "gated": True, "T": T}
            for T in plan.kernel_lengths for n in (1, 2)]
    _delta_stage(plan, path, rows, f"kernels.delta.delta_product (backend {backend}), forget gate on")


def stage_fla(plan: Plan, path: Path, deadline: float) -> None:
    if plan.device == "cuda":
        if not package_importable("fla"):
            write_json(path, {"error": "flash-linear-attention is not installed: carry the fla-core wheel in "
                                       ".whl/ (scripts/gpu_speed.sh installs it)", "rows": []})
            return
        backend, about = "fla", "flash-linear-attention chunk_delta_rule (no forget gate), through backend fla"
    else:
        backend, about = "torch", "dry run: our chunked delta rule stands in for flash-linear-attention"
    rows = [{"op": "theirs, n_h 1", "backend": backend, "n_h": 1, "gated": False, "T": T} for T in plan.kernel_lengths]
    _delta_stage(plan, path, rows, about)


def _repeats(plan: Plan, previous: dict | None, T: int, seconds: float) -> int:
    """Timed calls that fit ``seconds`` (``plan.repeats`` at most, 1 at least), predicting a forward+backward
    at ``T`` from the previous length's (linear in T); about four forward+backward's worth per repeat
    (forward, forward+backward, a graph replay, and their share of the warm-ups, the launch count and the
    capture)."""
    if not previous or not previous.get("fwd_bwd_ms"):
        return plan.repeats
    call = previous["fwd_bwd_ms"] / 1e3 * T / previous["T"]
    return max(1, min(plan.repeats, int(seconds / (4 * call)) - plan.warmup))


def stage_layers(plan: Plan, path: Path, deadline: float) -> None:
    device, dtype = torch.device(plan.device), DTYPES[plan.dtype]
    result = {"rows": []}
    names = mixer_names()[0]
    for i, name in enumerate(names):
        try:
            mixer = build_layer(name, plan, device, dtype)
        except Exception as err:  # noqa: BLE001
            result["rows"] += [{"mixer": name, "T": T, "error": f"build: {error_text(err)}"} for T in plan.layer_lengths]
            write_json(path, result)
            continue
        previous = None
        for j, T in enumerate(plan.layer_lengths):
            torch.manual_seed(T)
            rows_left = (len(names) - i) * len(plan.layer_lengths) - j
            repeats = _repeats(plan, previous, T, (deadline - time.time()) / rows_left)
            timed = measure(mixer, T, 1, device, dtype, plan.warmup, repeats, decode=False, memory=False)
            row = {"mixer": name, "backend": our_backend(name, plan.device), "T": T, "repeats": repeats,
                   **{k: timed.get(k) for k in ("fwd_ms", "fwd_bwd_ms", "error")}}
            previous = row
            if not row["error"]:
                try:
                    row.update(layer_breakdown(mixer, T, device, dtype).as_row())
                    row.update(layer_host(mixer, T, device, dtype))
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"launch count: {error_text(err)}"
                try:
                    row.update(layer_graph(mixer, T, device, dtype, plan.warmup, repeats))
                except Exception as err:  # noqa: BLE001
                    row["graph_error"] = error_text(err)
            result["rows"].append(row)
            write_json(path, result)
            free(device)
        del mixer
        free(device)


def lm_model(plan: Plan, name: str) -> tuple:
    """``(recipe, model)`` of ``name``'s language model in this run: ``plan.lm_layers`` of its layers
    (:func:`layer_entry`) at ``plan.lm_d_model``, the same initial weights every time (on the CPU)."""
    recipe = resolve({"model": {"d_model": plan.lm_d_model,
                                "layers": [layer_entry(name, plan, plan.lm_d_model)] * plan.lm_layers}})
    torch.manual_seed(0)
    return recipe, HybridLM.from_recipe(recipe, plan.lm_vocab)


def lm_rate(plan: Plan, name: str, T: int, seconds: float) -> dict:
    device = torch.device(plan.device)
    recipe, model = lm_model(plan, name)
    model = model.to(device)
    optimizer, _ = make_optimizer(model, recipe)
    batch = plan.lm_tokens // T
    ids = torch.randint(plan.lm_vocab, (batch, T + 1), device=device)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    autocast = DTYPES[plan.dtype] if device.type == "cuda" and plan.dtype != "fp32" else None
    with torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext():
        ahead = forward_backward_ahead(model, inputs)  # as zoo train does before its first step
    step = LMStep(model, optimizer, inputs, labels, autocast)
    rate = steady_rate(step, batch * T, device, plan.lm_warmup, plan.lm_steps, seconds / 2)
    kernels, host = breakdown(step, device), host_issue(step, device)
    row = {"batch": batch, "ahead_seconds": ahead.seconds, **rate.as_dict(), "step_launches": kernels.launches,
           "step_device_ms": round(kernels.device_ms, 3), "step_kernels": kernels.kernels[:STEP_KERNELS],
           "step_host_ms": host["host_ms"], "step_syncs": host["syncs"]}
    if device.type != "cuda":
        return {**row, "graph_error": "needs CUDA"}
    graphed = LMStep(model, optimizer, inputs, labels, autocast, cuda_graph=True)
    # the first call captures; it and an eager step from the same weights must agree (no optimizer step between)
    agree = agreement(step.passes, graphed.passes, graphed.batch)
    if graphed.passes.error is not None:
        return {**row, "graph_error": graphed.passes.error}
    graph_rate = steady_rate(graphed, batch * T, device, plan.lm_warmup, plan.lm_steps, seconds / 2)
    return {**row, "graph_loss_gap": agree["outputs"], "graph_grad_gap": agree["grads"],
            **{f"graph_{k}": v for k, v in graph_rate.as_dict().items()}}


def stage_lm(plan: Plan, path: Path, deadline: float) -> None:
    names = [BASELINE] + [n for n in mixer_names()[1]]
    runs = [(name, T) for name in names for T in plan.lm_lengths]
    result = {"rows": []}
    for i, (name, T) in enumerate(runs):
        share = max(1.0, 0.8 * (deadline - time.time()) / (len(runs) - i))  # 20 % kept for building models
        row = {"mixer": name, "backend": our_backend(name, plan.device), "T": T}
        try:
            row.update(lm_rate(plan, name, T, share))
        except Exception as err:  # noqa: BLE001
            row["error"] = error_text(err)
        result["rows"].append(row)
        write_json(path, result)
        free(torch.device(plan.device))


STAGE_FUNCTIONS = {"kernel": stage_kernel, "layers": stage_layers, "lm": stage_lm, "fla": stage_fla}


# ---------------------------------------------------------------------------------------------------- driver
def _child(fn, args, env: dict) -> None:
    os.environ.update(env)
    status = 0
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - the parent reads the exit status
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # not the parent's exit handlers


def start_child(fn, args: tuple, env: dict):
    """Start ``fn(*args)`` in a forked process with ``env`` added to its environment."""
    if torch.cuda.is_initialized():
        raise RuntimeError("gpu_speed: CUDA was initialised before a fork; the stages would inherit a broken context")
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(fn, args, env))
    proc.start()
    return proc


def child_outcome(proc, seconds: float, limit: float | None = None) -> str | None:
    """Wait for ``proc`` up to ``seconds`` (killing it past them): None once it has finished cleanly, else
    why it stopped (killed past its time ``limit``, by default ``seconds``, or its exit status)."""
    proc.join(max(seconds, 0.0))
    if proc.is_alive():
        proc.kill()
        proc.join()
        return f"ran past its {seconds if limit is None else limit:.0f} s limit"
    return None if proc.exitcode == 0 else f"failed with exit status {proc.exitcode} (traceback above)"


def in_child(fn, args: tuple, env: dict, seconds: float) -> str | None:
    """Run ``fn(*args)`` in a forked process with ``env`` added to its environment; None once it has
    finished, else why it stopped (killed past ``seconds``, or its exit status)."""
    return child_outcome(start_child(fn, args, env), seconds)


def _say(message: str) -> None:
    print(f"gpu_speed: {message}", flush=True)


def run(plan: Plan, parent: Path, stages: tuple = STAGES) -> int:
    # the stages fork from this process, so it must never initialise CUDA: a CUDA check here (there is none
    # meant to be) then asks NVML instead of the driver. Nor may it run a backward, which starts autograd's
    # device threads; they count the CUDA devices, which initialises the driver, and every forked stage then
    # fails with CUDA's "initialization error" (seen on an H200). What a process's first backward imports
    # (sympy, seconds on a slow CPU) is imported at the top instead, so that no mixer's first call pays it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    start = time.time()
    run_id = f"{start:.6f}"   # each stage file says which run wrote it (a ratio of two stages needs one run)
    deadline = start + plan.budget
    scratch = Path(tempfile.mkdtemp(prefix="zoo-gpu-speed-"))
    shared = {"TRITON_CACHE_DIR": str(scratch / "triton"), "TRITON_CACHE_AUTOTUNING": "1", "FLA_CACHE_RESULTS": "1"}
    try:
        why = in_child(stage_env, (plan, scratch / "env.json", deadline), shared, plan.limit("env"))
        env = read_json(scratch / "env.json") or {"error": f"the env stage {why}"}
        if "error" in env:
            _say(env["error"])
            return 2
        folder = parent / env["folder"]
        folder.mkdir(parents=True, exist_ok=True)
        # a previous run's summary goes first: a run stopped before its own leaves none, and --check then
        # builds it from the stage files instead of judging the previous run's numbers
        for name in ("summary.json", "summary.md"):
            (folder / name).unlink(missing_ok=True)
        write_json(folder / "env.json", env)
        _say(f"{env['card']}, commit {env['commit']}: writing {folder}")
        for stage in STAGES:
            if stage not in stages:
                continue
            path = folder / f"{stage}.json"
            path.unlink(missing_ok=True)
            keep = 0.0 if stage == "fla" else plan.fla_seconds
            limit = min(plan.limit(stage), deadline - time.time() - keep)
            began = time.time()
            if limit < 1:
                write_json(path, {"stopped": "not run: the run's time budget was spent", "rows": []})
                why = "not run: the run's time budget was spent"
            elif stage == "first_call":
                why = _first_calls(plan, path, scratch, shared, began + limit)
            else:
                why = in_child(STAGE_FUNCTIONS[stage], (plan, path, began + limit), shared, limit)
                if why:
                    data = read_json(path) or {"rows": []}
                    data["stopped"] = why
                    write_json(path, data)
            stamp(path, run_id)
            _say(f"{stage}: {why or 'done'} ({time.time() - began:.0f} s)")
        return conclude(folder, time.time() - start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def stamp(path: Path, run_id: str) -> None:
    """Mark the stage file ``path`` as written by the run ``run_id`` (its ``"run"``)."""
    data = read_json(path) or {"rows": []}
    data["run"] = run_id
    write_json(path, data)


def _first_calls(plan: Plan, path: Path, scratch: Path, shared: dict, deadline: float) -> str | None:
    """Each mixer's first call in a fresh process with an empty Triton cache, ``plan.first_call_workers`` at a
    time (each compiles its layer's kernels ahead on its share of the cores; the card runs the calls themselves
    in milliseconds); each cache is merged into the run's shared one as its process ends."""
    names = mixer_names()[0]
    result = {"T": plan.first_call_length, "concurrent": plan.first_call_workers, "rows": {}}
    waiting, running = list(names), {}        # name -> (process, its json, its cache, its limit, started)
    while waiting or running:
        while waiting and len(running) < plan.first_call_workers and deadline - time.time() >= 1:
            name = waiting.pop(0)
            cache, out = scratch / "first" / name, scratch / f"first-{name}.json"
            proc = start_child(stage_first_call, (plan, name, out, deadline),
                               {**shared, "TRITON_CACHE_DIR": str(cache)})
            running[name] = (proc, out, cache, min(plan.first_call_seconds, deadline - time.time()), time.time())
        if not running:  # the stage's time was spent before these started
            for name in waiting:
                result["rows"][name] = {"error": "not reached: the stage's time was spent"}
            break
        for name, (proc, out, cache, limit, began) in list(running.items()):
            if proc.is_alive() and time.time() - began < limit:
                continue
            why = child_outcome(proc, 0.0, limit)
            del running[name]
            result["rows"][name] = read_json(out) or {"error": why or "wrote nothing"}
            write_json(path, result)
            if cache.exists():
                shutil.copytree(cache, shared["TRITON_CACHE_DIR"], dirs_exist_ok=True)
        time.sleep(0.02)
    result["rows"] = {name: result["rows"][name] for name in names}
    write_json(path, result)
    reached = [n for n in names if "not reached" not in result["rows"][n].get("error", "")]
    return None if len(reached) == len(names) else f"{len(names) - len(reached)} mixers not reached"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.benchmark.gpu_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same pipeline at toy sizes on the CPU")
    parser.add_argument("--out", default=None, help="the folder that gets bench-gpu-<card>/ (default: $OUT where "
                                                     "set, else tables/; a temporary folder for --dry-run)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 420)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated stages to run, the others' files kept (default {','.join(STAGES)})")
    parser.add_argument("--check", metavar="DIR", default=None, help="only the verdicts of a finished folder")
    args = parser.parse_args(argv)
    try:
        if args.check:
            return check_folder(Path(args.check))
        stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
        unknown = sorted(set(stages) - set(STAGES))
        if unknown:
            raise UserError(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
        plan = DRY if args.dry_run else FULL
        if args.budget is not None:
            if args.budget <= 0:
                raise UserError("--budget must be a positive number of seconds")
            plan = dataclasses.replace(plan, budget=args.budget)
        if args.out:
            parent = Path(args.out)
        elif args.dry_run:
            parent = Path(tempfile.mkdtemp(prefix="zoo-gpu-speed-dry-"))
        else:
            parent = Path(os.environ.get("OUT") or "tables")
        return run(plan, parent, stages)
    except UserError as err:
        parser.exit(2, f"gpu_speed: error: {err}\n")


if __name__ == "__main__":
    raise SystemExit(main())
