"""The Clebsch-Gordan key lift against an independent complex-number computation: the invariant channel
|z|^2 does not move when each pair is rotated by its own angle, the second harmonic z^2 rotates by twice
the angle; shapes, degree-2 homogeneity and refusals."""
import pytest
import torch

from mixers.key_lift import KEY_LIFTS, key_lift, lifted_dim


def _pairs(x):
    """(..., r) real -> (..., r/2) complex z_i = x_{2i} + i x_{2i+1}."""
    return torch.complex(x[..., 0::2], x[..., 1::2])


def _rotate(x, theta):
    """Rotate pair i of x by theta_i (a complex product, then back to interleaved real components)."""
    z = _pairs(x) * torch.polar(torch.ones_like(theta), theta)
    return torch.view_as_real(z).flatten(-2)


@pytest.mark.parametrize("r", [2, 6, 10])
def test_invariant_channel_ignores_rotations_and_harmonic_rotates_twice(r):
    x = torch.randn(3, 7, r, dtype=torch.float64)
    theta = (2 * torch.rand(3, 7, r // 2, dtype=torch.float64) - 1) * torch.pi * 3
    xr = _rotate(x, theta)
    assert not torch.allclose(xr, x)                        # the rotation moved the key
    z, zr = _pairs(x), _pairs(xr)

    inv, inv_r = key_lift(x, "cg_invariant"), key_lift(xr, "cg_invariant")
    torch.testing.assert_close(inv, z.abs().square(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(inv_r, inv, rtol=1e-12, atol=1e-12)

    full, full_r = key_lift(x, "cg"), key_lift(xr, "cg")
    h = r // 2
    torch.testing.assert_close(full[..., :h], inv, rtol=0, atol=0)         # invariant block first
    torch.testing.assert_close(full_r[..., :h], inv, rtol=1e-12, atol=1e-12)
    harm, harm_r = _pairs(full[..., h:]), _pairs(full_r[..., h:])          # then (Re z^2, Im z^2) pairs
    torch.testing.assert_close(harm, z * z, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(harm_r, zr * zr, rtol=1e-12, atol=1e-12)
    twice = torch.polar(torch.ones_like(theta), 2 * theta)
    torch.testing.assert_close(harm_r, harm * twice, rtol=1e-12, atol=1e-12)
    # not invariant: the harmonic channel does move with the rotation
    assert (harm_r - harm).abs().max() > 1e-3


@pytest.mark.parametrize("lift", KEY_LIFTS)
def test_shapes_and_degree_two(lift):
    r = 8
    x = torch.randn(2, 5, 3, r, dtype=torch.float64)
    y = key_lift(x, lift)
    assert y.shape == (2, 5, 3, lifted_dim(r, lift))
    assert lifted_dim(r, lift) == {"none": r, "cg_invariant": r // 2, "cg": 3 * r // 2}[lift]
    c = 1.7
    expected = y * (c if lift == "none" else c * c)
    torch.testing.assert_close(key_lift(c * x, lift), expected, rtol=1e-12, atol=1e-12)
    if lift == "none":
        assert y is x


def test_refusals():
    with pytest.raises(ValueError, match="must be even, got 5"):
        key_lift(torch.randn(2, 5), "cg")
    with pytest.raises(ValueError, match="unknown key lift 'cg_inv'"):
        key_lift(torch.randn(2, 4), "cg_inv")
    with pytest.raises(ValueError, match="unknown key lift"):
        lifted_dim(4, "harmonic")
