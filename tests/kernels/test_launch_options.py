"""kernels.launch: every launch is counted with the warps and stages it ran with, and launch_options gives
named kernels other ones without changing what they compute."""
import pytest
import torch

from kernels.backend import triton_interpreting
from kernels.launch import counting, launch_options

pytestmark = pytest.mark.skipif(not triton_interpreting() and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")


def _log_decay():
    from kernels.gate.triton import log_decay_triton
    H = int(torch.randint(2, 6, ()))
    args = (torch.randn(2, int(torch.randint(8, 40, ())), H), torch.randn(H), torch.randn(H))
    return lambda: log_decay_triton(*args)


def test_launches_are_counted_with_their_options_and_launch_options_replaces_them():
    run = _log_decay()
    with counting() as plain:
        reference = run()
    (name,) = list(plain)
    assert len(plain.options[name]) == 1
    (own,) = plain.options[name]
    warps, stages = own
    while (warps, stages) == own:      # options the launcher would not pick itself, or the test could not fail
        warps, stages = int(2 ** torch.randint(1, 4, ())), int(torch.randint(1, 5, ()))
    with launch_options({name: {"num_warps": warps, "num_stages": stages}}), counting() as tuned:
        out = run()
    assert tuned.options[name] == {(warps, stages)} and tuned[name] == plain[name]
    assert torch.equal(out, reference)
    with launch_options({"gate.another_kernel": {"num_warps": 8}}), counting() as other:
        run()
    assert other.options == plain.options      # options for other kernels leave this one alone
    with counting() as after:
        run()
    assert after.options == plain.options      # and nothing is left behind


def test_options_nest_and_the_inner_ones_win():
    run = _log_decay()
    with counting() as plain:
        run()
    (name,) = list(plain)
    with launch_options({name: {"num_warps": 2, "num_stages": 1}}):
        with launch_options({name: {"num_warps": 8, "num_stages": 2}}), counting() as inner:
            run()
        with counting() as outer:
            run()
    assert inner.options[name] == {(8, 2)} and outer.options[name] == {(2, 1)}


def test_host_only_launches_do_everything_but_run_the_kernel():
    from kernels.gate.reference import log_decay_reference
    from kernels.gate.triton import log_decay_triton
    from kernels.launch import host_only
    H = int(torch.randint(2, 6, ()))
    raw, A, bias = torch.randn(2, int(torch.randint(8, 40, ())), H), torch.randn(H), torch.randn(H)
    expected = log_decay_reference(raw, A, bias)
    with counting() as outside:
        ran = log_decay_triton(raw, A, bias)
    torch.testing.assert_close(ran, expected)
    # inside, the launcher allocates and launches as always (counted, with its options) and nothing computes:
    # the output keeps whatever its allocation held
    with host_only(), counting() as inside:
        out = log_decay_triton(raw, A, bias)
    assert dict(inside) == dict(outside) and inside.options == outside.options
    assert not torch.allclose(out, expected)
    with counting() as after:                  # and the next launch runs again
        again = log_decay_triton(raw, A, bias)
    torch.testing.assert_close(again, expected)
    assert dict(after) == dict(outside)
