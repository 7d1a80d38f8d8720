"""kronecker_slots mixer: every memory backend gives the same mixer (outputs and parameter gradients);
the GPU path gives the CPU path's layer for the non-default options; the non-default options keep parallel ==
recurrent; finite outputs and gradients at T = 4096 and with all-equal keys; honest state and active-state
sizes; straight-through forward weights; option checks.
"""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_importable, triton_usable_for
from mixers import build_mixer
from mixers.options import OptionError
from tests.kernels.harness import assert_rel_close, rel_err
from tests.mixers.gpu_path import assert_gpu_path_matches

D = 32
SMALL = {"n_heads": 2, "d_v": 8, "d_p": 4, "U": 2, "top_k": 3, "chunk_size": 8}


def make(dtype=torch.float64, **opts):
    m = build_mixer("kronecker_slots", D, {**SMALL, **opts}).to(dtype)
    with torch.no_grad():
        for p in m.parameters():  # gamma and the position map away from their init values
            if p.ndim == 1 and p.shape[0] == m.n_heads:
                p.uniform_(-1.0, 1.5)
        if getattr(m, "pos_proj", None) is not None:
            m.pos_proj.weight.normal_(0, 0.5)
    return m


def _run(m, x):
    y = m(x)
    m.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = m(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("kernel", [{"memory_layout": "dense"}, {"memory_layout": "sparse"},
                                    {"backend": "torch", "memory_layout": "sparse"}, {"backend": "sparse"},
                                    {"backend": "triton"}], ids=str)
def test_backends_give_the_same_mixer(kernel):
    if kernel.get("backend") == "triton" and not (triton_importable() and triton_usable_for(torch.empty(0))):
        pytest.skip("triton is not installed, or there is no CUDA device and TRITON_INTERPRET is unset")
    dtype = torch.float32
    ref = make(torch.float64, backend="reference")
    m = make(dtype, **kernel)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 9, D, dtype=torch.float64)
    y_r, gx_r, gp_r = _run(ref, x)
    y, gx, gp = _run(m, x.to(dtype))
    # the token loop in fp32 too: what fp32 arithmetic alone costs this draw. A gradient can nearly cancel (the
    # read projection's, about 1 draw in 1000, at 1e-3 of its usual norm), and then every fp32 backend, the
    # token loop included, is 1e-3 from fp64 relative to it; a backend is held to 4x the loop's error there
    loop = make(dtype, backend="reference")
    loop.load_state_dict(ref.state_dict())
    y_l, gx_l, gp_l = _run(loop, x.to(dtype))

    def close(got, loop_got, want, tol, what):
        assert_rel_close(got, want, max(tol, 4 * rel_err(loop_got, want)), what)

    close(y, y_l, y_r, 1e-5, "output")
    close(gx, gx_l, gx_r, 1e-4, "input gradient")
    for n in gp_r:
        close(gp[n], gp_l[n], gp_r[n], 1e-4, f"gradient of {n}")


@pytest.mark.parametrize("opts", [
    {"pos_address": True},
    {"renormalize": False, "tau": 0.5},
    {"topk_grad": "straight_through", "tie_addresses": True},
    {"conv_size": 1},
    {"shift_write_address": True, "tie_addresses": True},
    {"shift_write_address": True, "conv_size": 1, "pos_address": True},
    {"memory_layout": "sparse", "d_p": 8, "U": 3, "top_k": 5},
])
def test_options_keep_parallel_equal_to_recurrent(opts):
    m = make(**opts)
    x = torch.randn(2, 17, D, dtype=torch.float64)
    with torch.no_grad():
        y = m(x)
        y_rec, _ = m.forward_recurrent(x)
        y_pre, state = m.prefill(x[:, :10])
        ys = [y_pre]
        for t in range(10, 17):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t[:, None])
    assert_rel_close(y_rec, y, 1e-10, "recurrent")
    assert_rel_close(torch.cat(ys, 1), y, 1e-10, "prefill + decode")


@pytest.mark.skipif(not (triton_importable() and triton_usable_for(torch.empty(0))),
                    reason="triton is not installed, or there is no CUDA device and TRITON_INTERPRET is unset")
@pytest.mark.parametrize("opts,sparse", [
    ({"renormalize": False, "tau": 0.5}, False),
    ({"topk_grad": "straight_through", "tie_addresses": True}, False),
    ({"shift_write_address": True, "conv_size": 1, "pos_address": True}, False),
    ({"d_p": 3, "U": 3, "top_k": 5}, False),
    ({"d_p": 3, "U": 3, "top_k": 5}, True),
], ids=str)
def test_gpu_path_equals_cpu_path_for_the_options(opts, sparse, monkeypatch):
    """The GPU path (joint write-and-read addressing in one Triton kernel, the decays inside the memory kernels,
    strided inputs) against the CPU path of the same fp32 layer, for the options the default-options check of
    tests/mixers/test_gpu_path.py does not reach: outputs, final state, input and parameter gradients, each
    judged against the fp64 CPU path (tests/mixers/gpu_path.py: a parameter gradient can cancel to rounding
    level, 1e-12 here for q_proj with positional addresses, where two fp32 paths differ by 5e-4 relative).
    ``sparse``: the Triton memory's sequential scan, which runs above CHUNKED_MAX_SLOTS (lowered here: at a
    real M of 512 slots a short sequence hardly ever writes a slot twice, and the gradients of the addresses
    and of gamma would be ~0 on both paths, a comparison of rounding noise)."""
    import kernels.slots.triton as slots_triton
    from kernels.launch import counting
    if sparse:
        monkeypatch.setattr(slots_triton, "CHUNKED_MAX_SLOTS", 8)
    m = make(torch.float32, **opts)
    x, dy = torch.randn(1, 13, D), torch.randn(1, 13, D)
    with counting() as kernels:  # the CPU paths (fp32 and fp64) launch no Triton kernel
        assert_gpu_path_matches(m, x, dy, 1e-4, str(opts))
    assert kernels["slots._topk_fwd"] == (1 if opts.get("pos_address") else 0) + 1 and kernels["slots._topk_bwd"]
    assert kernels["slots._slots_fwd" if sparse else "slots._slots_state"] == 1 + sparse  # the sparse scan replays


@pytest.mark.parametrize("case", ["long", "all_equal"])
def test_finite_on_long_and_all_equal_inputs(case):
    m = make(torch.float32, backend="auto", d_p=8, U=3).train()  # M = 512: the sparse path
    x = (torch.randn(1, 4096, D) if case == "long" else torch.randn(1, 1, D).expand(2, 64, D).contiguous())
    x.requires_grad_(True)
    y = m(x)
    assert torch.isfinite(y).all()
    (y * torch.randn_like(y)).sum().backward()
    assert torch.isfinite(x.grad).all()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_all_equal_keys_average_the_values():
    """Every token writes and reads the same K slots with the same weights: the read is the power-decay
    average of the values so far, identical across heads' slots, so with gamma -> 0 (no forgetting)
    the output of token t depends on the mean of v_1..v_t only."""
    m = make(torch.float64, conv_size=1)
    with torch.no_grad():
        m.k_proj.weight.zero_()
        m.q_proj.weight.zero_()
        m.gamma_raw.fill_(-30.0)  # gamma ~ 1e-13: no forgetting
    x = torch.randn(1, 12, D, dtype=torch.float64)
    x_perm = torch.cat([x[:, :5].flip(1), x[:, 5:]], 1)  # same multiset of the first 5 tokens
    with torch.no_grad():
        y, y_perm = m(x), m(x_perm)
    assert_rel_close(y_perm[:, 5:], y[:, 5:], 1e-9)
    assert not torch.allclose(y_perm[:, :5], y[:, :5])


def test_state_sizes():
    small, big = make(U=2), make(U=4)
    for m in (small, big):
        _, state = m.prefill(torch.randn(3, 5, D, dtype=torch.float64))
        assert sum(t.numel() for t in state.values()) // 3 == m.state_size(5)
        conv = (m.options.conv_size - 1) * (2 * m.addr_dim + m.n_heads * m.d_v)
        assert m.state_size(5) == m.state_size(5000) == m.n_heads * m.num_slots * (m.d_v + 1) + conv
    assert big.state_size(1) - big._conv_state_size() == 16 * (small.state_size(1) - small._conv_state_size())
    assert (big.active_state_size(1) - big._conv_state_size() == small.active_state_size(1) - small._conv_state_size()
            == 2 * 2 * 3 * 9)
    for opts in ({"pos_address": True}, {"shift_write_address": True, "conv_size": 1}):
        m = make(**opts)
        _, state = m.prefill(torch.randn(2, 4, D, dtype=torch.float64))
        assert sum(t.numel() for t in state.values()) // 2 == m.state_size(4)
        assert sum(t.numel() for t in m.init_state(2).values()) // 2 == m.state_size(4)


def test_straight_through_writes_hard_weights():
    m = make(topk_grad="straight_through")
    logits = torch.randn(2, 5, m.addr_dim, dtype=torch.float64, requires_grad=True)
    _, w = m._address(logits)
    assert torch.allclose(w, torch.full_like(w, 1 / 3), atol=1e-15)
    (w * torch.randn_like(w)).sum().backward()
    assert logits.grad.abs().sum() > 0


@pytest.mark.parametrize("kernel, path", [({}, "dense"), ({"memory_layout": "sparse"}, "sparse"),
                                          ({"backend": "sparse"}, "sparse"), ({"memory_layout": "dense"}, "dense")])
def test_memory_layout_reaches_the_kernel(kernel, path, monkeypatch):
    """``memory_layout`` (or its older spelling ``backend: sparse``) picks the torch path that runs; at
    M = 16 slots ``auto`` is the dense chunked one."""
    import kernels.slots as slots
    called = []
    for name in ("slot_memory_chunked", "slot_memory_sparse"):
        real = getattr(slots, name)
        spy = lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k)  # noqa: E731
        monkeypatch.setattr(slots, name, spy)
    make(**kernel)(torch.randn(1, 5, D, dtype=torch.float64))
    assert called == [{"dense": "slot_memory_chunked", "sparse": "slot_memory_sparse"}[path]]


def test_memory_layout_is_left_out_of_recipes_at_its_default():
    from mixers.options import plain_options
    assert "memory_layout" not in plain_options(make().options)
    assert plain_options(make(memory_layout="sparse").options)["memory_layout"] == "sparse"


def test_bad_options_raise():
    with pytest.raises(OptionError, match="memory_layout='dense' chooses between the torch backend's paths"):
        build_mixer("kronecker_slots", D, {"backend": "reference", "memory_layout": "dense"})
    with pytest.raises(OptionError, match="contradicts memory_layout='dense'"):
        build_mixer("kronecker_slots", D, {"backend": "sparse", "memory_layout": "dense"})
    with pytest.raises(OptionError, match="top_k"):
        build_mixer("kronecker_slots", D, {"d_p": 2, "U": 2, "top_k": 5})
    with pytest.raises(OptionError, match="d_p"):
        build_mixer("kronecker_slots", D, {"d_p": 1})
    with pytest.raises(OptionError, match="topk_grad"):
        build_mixer("kronecker_slots", D, {"topk_grad": "gumbel"})
