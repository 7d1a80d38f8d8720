"""The defective-Jordan SSM's own claims: c = 0 is a diagonal SSM, the init options give the
documented transitions (rho I, rho I + N, the discretised HiPPO-LegS block), the paper's per-step
LayerNorm mode is that recurrence, every mode's parallel form equals its recurrence, and a defective
block's impulse response peaks near k_max = (m - 1) / -ln(rho) ("The Illusion of State", Theorem 2.1),
and an fp16 layer stays finite wherever the values it returns fit fp16."""
import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from kernels.backend import triton_usable_for
from kernels.device import gpu_path_on_cpu
from mixers import build_mixer
from tests.mixers import contract


def make(d_model=12, dtype=torch.float64, **options):
    opts = {"chunk_size": int(torch.randint(1, 9, (1,))), **options}
    return build_mixer("jordan", d_model, opts).to(dtype)


def _ssm_loop(x, lam_fn, A_fn, B, C, norm=None):
    """Independent recurrence: h_t = A(lam_t) h_{t-1} + B x_t (then LN per block if norm), y = C h."""
    Bsz, T, _ = x.shape
    h = None
    ys = []
    for t in range(T):
        bx = (x[:, t] @ B.T).reshape(Bsz, -1, A_fn(lam_fn(x[:, t])).shape[-1])
        A = A_fn(lam_fn(x[:, t]))
        h = bx if h is None else torch.einsum("bnij,bnj->bni", A, h) + bx
        if norm is not None:
            w, b, eps = norm
            h = F.layer_norm(h, h.shape[-1:], eps=eps) * w + b
        ys.append(h.flatten(1) @ C.T)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("decay", ["fixed", "selective"])
def test_c0_equals_diagonal_ssm(decay):
    d, N, m = 12, 3, 4
    mixer = make(d, block_size=m, n_blocks=N, init="diagonal", decay=decay, rho=0.8)
    x = torch.randn(2, 29, d, dtype=torch.float64)
    with torch.no_grad():
        y = mixer(x)
    B, C = mixer.in_proj.weight, mixer.out_proj.weight
    if decay == "fixed":
        lam_fn = lambda xt: torch.full((xt.shape[0], N), 0.8, dtype=xt.dtype)
    else:
        gate = mixer.gate
        lam_fn = lambda xt: torch.exp(-gate.A_log.exp() * F.softplus(xt @ gate.proj.weight.T + gate.dt_bias))
    # diagonal: every channel decays on its own
    ref = _ssm_loop(x, lam_fn, lambda lam: lam[..., None, None] * torch.eye(m, dtype=x.dtype), B, C).detach()
    assert torch.allclose(y, ref, rtol=1e-10, atol=1e-12), (y - ref).abs().max()


def _hippo_by_hand(m, rho):
    H = torch.zeros(m, m, dtype=torch.float64)
    for i in range(m):
        for j in range(m):
            if i > j:
                H[i, j] = -math.sqrt((2 * i + 1) * (2 * j + 1))
            elif i == j:
                H[i, j] = -(i + 1)
    s = torch.linalg.svdvals(H).max()
    return torch.eye(m, dtype=torch.float64) + (1 - rho) * H / s


@pytest.mark.parametrize("m", [1, 3, 16])
def test_init_options_give_documented_transitions(m):
    rho = 0.9
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    eye = torch.eye(m, dtype=torch.float64)
    shift = torch.diag(torch.ones(m - 1, dtype=torch.float64), 1)
    for init, expected in (("diagonal", rho * eye), ("defective", rho * eye + shift), ("hippo", _hippo_by_hand(m, rho))):
        mixer = make(16, block_size=m, n_blocks=2, decay="fixed", rho=rho, init=init)
        A = mixer.transition_matrix(x).detach()
        assert A.shape == (2, 5, 2, m, m)
        assert torch.allclose(A, expected.expand_as(A), atol=1e-6), init
    hip = _hippo_by_hand(m, rho)
    eig = torch.linalg.eigvals(hip)
    # lower triangular: eigenvalues = diagonal, distinct (diagonalisable), spectral radius in [rho, 1)
    assert torch.allclose(eig.real.sort().values, hip.diagonal().sort().values) and (eig.imag.abs() < 1e-12).all()
    assert hip.diagonal().min() >= rho - 1e-12 and hip.diagonal().max() < 1
    # selective decay: lam_t I + N, lam_t in (0, 1), varying with the input
    sel = make(16, block_size=m, n_blocks=2, decay="selective", init="defective")
    A = sel.transition_matrix(x).detach()
    lam = A.diagonal(dim1=-2, dim2=-1)
    assert ((lam > 0) & (lam < 1)).all() and torch.allclose(lam, lam[..., :1].expand_as(lam))
    assert torch.equal(A - torch.diag_embed(lam), shift.expand_as(A))


def test_step_norm_is_layernorm_of_the_state_every_step():
    d, N, m, eps = 10, 2, 5, 1e-5
    mixer = make(d, block_size=m, n_blocks=N, decay="selective", init="defective", state_norm="step", norm_eps=eps)
    with torch.no_grad():
        mixer.norm_weight.normal_(1, 0.3)
        mixer.norm_bias.normal_(0, 0.3)
        mixer.coupling.normal_(1, 0.3)
    x = torch.randn(2, 17, d, dtype=torch.float64)
    with torch.no_grad():
        y = mixer(x)
    gate = mixer.gate
    lam_fn = lambda xt: torch.exp(-gate.A_log.exp() * F.softplus(xt @ gate.proj.weight.T + gate.dt_bias))
    c = mixer.coupling.detach()
    shift = torch.diag(torch.ones(m - 1, dtype=torch.float64), 1)
    A_fn = lambda lam: lam[..., None, None] * torch.eye(m, dtype=torch.float64) + c[:, None, None] * shift
    ref = _ssm_loop(x, lam_fn, A_fn, mixer.in_proj.weight, mixer.out_proj.weight,
                    norm=(mixer.norm_weight, mixer.norm_bias, eps)).detach()
    assert torch.allclose(y, ref, rtol=1e-9, atol=1e-11), (y - ref).abs().max()


MODES = [
    {"decay": "fixed", "init": "defective", "state_norm": "none"},
    {"decay": "fixed", "init": "hippo", "state_norm": "readout"},
    {"decay": "fixed", "init": "hippo", "state_norm": "none"},
    {"decay": "selective", "init": "defective", "state_norm": "step"},
    {"decay": "fixed", "init": "defective", "state_norm": "step"},
    {"decay": "selective", "init": "diagonal", "state_norm": "readout"},
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("mode", MODES, ids=lambda o: "-".join(o.values()))
def test_every_mode_parallel_equals_recurrent_and_decode(mode, dtype, tol):
    """The recurrence and prefill + decode give the parallel form's output (contract.assert_paths_agree). A
    LayerNorm divides by its block's spread (about 0.34 here), and a block of three components lands almost flat
    on some draws (a spread of 0.017 before the step norm on one): the rounding of every fp32 path grows 20-fold
    there (the parallel form 2.0e-5 from fp64, the token loop 0.7e-5; 7 draws in 3000 above 5e-6 apart)."""
    mixer = make(12, dtype, block_size=3, n_blocks=3, **mode).eval()
    x = torch.randn(2, 19, 12, dtype=dtype)
    with torch.no_grad():
        y = mixer(x)
        y_rec, _ = mixer.forward_recurrent(x)
        y_pre, state = mixer.prefill(x[:, :11])
        ys = [y_pre]
        for t in range(11, 19):
            y_t, state = mixer.step(x[:, t], state)
            ys.append(y_t[:, None])
    contract.assert_paths_agree(mixer, x, y_rec, y, tol, "recurrent vs parallel")
    contract.assert_paths_agree(mixer, x, torch.cat(ys, 1), y, tol, "prefill + decode vs parallel")
    assert y.dtype == dtype


def test_defective_impulse_response_peaks_near_k_max():
    # Theorem 2.1 / eq. (3): ||J^k e_m|| ~ k^{m-1} rho^k peaks near (m - 1) / -ln(rho); diagonal peaks at 0
    m, rho, T = 4, 0.9, 120
    k_max = (m - 1) / -math.log(rho)  # 28.5
    peaks = {}
    for init in ("defective", "diagonal"):
        mixer = make(m, block_size=m, n_blocks=1, decay="fixed", rho=rho, init=init, learn_transition=False)
        with torch.no_grad():
            mixer.in_proj.weight.copy_(torch.eye(m, dtype=torch.float64).flip(0))  # x = e_1 -> b = e_m
            x = torch.zeros(1, T, m, dtype=torch.float64)
            x[0, 0, 0] = 1.0
            norms = [mixer.prefill(x[:, :k + 1])[1]["h"].norm().item() for k in range(T)]
        peaks[init] = max(range(T), key=norms.__getitem__)
    assert peaks["diagonal"] == 0
    assert abs(peaks["defective"] - k_max) <= 3, peaks


@pytest.mark.parametrize("opts,match", [({"init": "hippo", "decay": "selective"}, "decay=fixed"),
                                        ({"init": "hippo", "decay": "fixed", "state_norm": "step"}, "hippo"),
                                        ({"block_size": 1, "state_norm": "step"}, "block_size"),
                                        ({"rho": 1.0}, "rho")])
def test_bad_options_raise(opts, match):
    with pytest.raises(ValueError, match=match):
        build_mixer("jordan", 8, opts)


# --- fp16 ------------------------------------------------------------------------------------------------------
# The contract's layer (d_model 32, four blocks of m = 4, c = 1, selective decay) in fp16 against a copy of the
# same fp16 weights in fp64, fed the same fp16 inputs. At init some blocks decay slowly (lam ~ 0.99), so the
# k^{m-1} transient makes the unnormalised state grow about like T^3: after 64-96 tokens it exceeds fp16's
# 65504 while the output and the input gradient (~4x smaller) still fit. The values returned in fp16 are
# rounded once (unit roundoff 2^-11 = 4.9e-4 per element; measured 2.0e-4 to 2.1e-4 in norm over the outputs,
# the decoded outputs and the input gradient): FP16_TOL is 2^-10. The states are returned in fp32 (measured
# 4e-8 to 5e-7 after 96 fp32 steps): STATE_TOL is 1e-5.
FP16_TOL = 2.0 ** -10
STATE_TOL = 1e-5
FP16_MAX = torch.finfo(torch.float16).max
PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not triton_usable_for(torch.empty(0)),
                                                             reason="needs Triton (interpreter)"))]


def _rel(a, exact):
    assert torch.isfinite(a).all(), f"non-finite values where the fp64 values reach {exact.abs().max().item():.3g}"
    return ((a.double() - exact).norm() / exact.norm()).item()


def _fp16_and_fp64(seed, T, dy_scale=1.0, gpu=False, decode=False):
    """The fp16 layer and its fp64 copy on the same fp16 inputs: outputs, final state, input and parameter
    gradients (and the token-by-token decode when ``decode``); the fp16 run on the GPU path when ``gpu``. The
    fp64 run also records the largest scan state read out and the largest gradient of ``b = B x``."""
    torch.manual_seed(seed)
    m16 = contract.make("jordan", torch.float16)
    m64 = copy.deepcopy(m16).double()
    x = torch.randn(2, T, contract.D_MODEL).half()
    dy = (torch.randn(2, T, contract.D_MODEL) * dy_scale).half()
    peaks = {}

    def track(name, t):
        peaks[name] = max(peaks.get(name, 0.0), t.abs().max().item())

    def watch_b(module, inputs, b):
        if b.requires_grad:
            b.register_hook(lambda g: track("db", g))

    m64.out_proj.register_forward_hook(lambda module, inputs, out: track("h", inputs[0]))
    m64.in_proj.register_forward_hook(watch_b)
    runs = {}
    for m, dtype in ((m16, torch.float16), (m64, torch.float64)):
        xx = x.detach().to(dtype).requires_grad_()
        with gpu_path_on_cpu() if gpu and dtype == torch.float16 else contextlib.nullcontext():
            y, state = m.prefill(xx)
            y.backward(dy.to(dtype))
            run = {"output": y.detach(), "state": state["h"], "input gradient": xx.grad,
                   **{f"gradient of {n}": p.grad for n, p in m.named_parameters()}}
            if decode:
                state, ys = m.init_state(2, dtype=dtype), []
                with torch.no_grad():
                    for t in range(T):
                        y_t, state = m.step(xx.detach()[:, t], state)
                        ys.append(y_t)
                run.update({"decoded output": torch.stack(ys, 1), "decoded state": state["h"]})
        runs[dtype] = run
    return runs[torch.float16], runs[torch.float64], peaks


@pytest.mark.parametrize("gpu", PATHS, ids=["cpu-path", "gpu-path"])
def test_fp16_forward_and_decode_finite_while_the_state_exceeds_fp16(gpu):
    """96 tokens: the exact state reaches ~1.5x fp16's range, the output a third of it. The state was rounded
    to fp16 for the readout (inf), in the parallel form and in the decode."""
    half, exact, peaks = _fp16_and_fp64(seed=10, T=96, gpu=gpu, decode=True)
    assert peaks["h"] > 1.4 * FP16_MAX, peaks                        # the case in question
    assert exact["output"].abs().max() < FP16_MAX / 2
    for what in ("output", "decoded output"):
        assert _rel(half[what], exact[what]) < FP16_TOL, what
    for what in ("state", "decoded state"):
        assert half[what].dtype == torch.float32 and _rel(half[what], exact[what]) < STATE_TOL, what


@pytest.mark.parametrize("gpu", PATHS, ids=["cpu-path", "gpu-path"])
def test_fp16_backward_finite_while_the_gradient_of_b_exceeds_fp16(gpu):
    """64 tokens: the state and the output fit fp16, the gradient reaching ``b = B x`` does not (~1.8x its
    range) while the input gradient does (a third). That gradient was rounded to fp16 for ``B``'s backward
    (inf in the input gradient). Parameter gradients are in the parameters' fp16: with the upstream gradient
    scaled by 2^-6, as a loss scale would, every one fits and matches too."""
    half, exact, peaks = _fp16_and_fp64(seed=0, T=64, gpu=gpu)
    assert peaks["h"] < FP16_MAX and peaks["db"] > 1.8 * FP16_MAX, peaks   # the case in question
    assert exact["input gradient"].abs().max() < FP16_MAX / 2
    assert _rel(half["output"], exact["output"]) < FP16_TOL
    assert _rel(half["input gradient"], exact["input gradient"]) < FP16_TOL

    half, exact, _ = _fp16_and_fp64(seed=0, T=64, dy_scale=2.0 ** -6, gpu=gpu)
    grads = [k for k in exact if k.startswith("gradient of")]
    assert len(grads) == 6 and max(exact[k].abs().max().item() for k in grads) < FP16_MAX / 2
    for what in ["input gradient"] + grads:
        assert _rel(half[what], exact[what]) < FP16_TOL, what


def test_fp16_autocast_over_an_fp32_layer_keeps_the_state_out_of_fp16():
    """Mixed precision (fp32 weights under fp16 autocast, how fp16 training runs), at the 96 tokens where the
    exact state exceeds fp16's range: autocast ran the readout's matmul on the state rounded to fp16 (inf). The
    projections around the scan run outside autocast, as in an fp16 model: the state matches the fp64 layer to
    within fp32 rounding (1e-5); the output leaves in fp16, as a linear layer's does under autocast, so the
    gradient that comes back is rounded to fp16 once and every gradient is within FP16_TOL."""
    torch.manual_seed(10)
    m32 = contract.make("jordan", torch.float16).float()  # weights exact in fp16, as in the tests above
    m64 = copy.deepcopy(m32).double()
    # inputs exact in fp16 (autocast rounds x to fp16 for the projections)
    x, dy = torch.randn(2, 96, contract.D_MODEL).half().float(), torch.randn(2, 96, contract.D_MODEL)
    runs = {}
    for m, dtype in ((m32, torch.float32), (m64, torch.float64)):
        xx = x.detach().to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float32):
            y, state = m.prefill(xx)
        y.backward(dy.to(dtype))
        runs[dtype] = {"output": y.detach(), "state": state["h"], "input gradient": xx.grad,
                       **{f"gradient of {n}": p.grad for n, p in m.named_parameters()}}
    assert runs[torch.float64]["state"].abs().max() > FP16_MAX                # the case in question
    for what, exact in runs[torch.float64].items():
        assert _rel(runs[torch.float32][what], exact) < (1e-5 if what == "state" else FP16_TOL), what
