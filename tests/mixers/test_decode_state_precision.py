"""Decode states after a prefill keep the layout and precision of ``init_state``, so that a long decode stays on
``forward``: a prefill under bf16 autocast, and a model held in a 16-bit dtype."""
import torch

from .contract import AUTOCAST_DECODE_RTOL, D_MODEL, make, rel


def test_ska_decode_after_an_autocast_prefill_accumulates_its_statistics_in_fp32():
    """SKA's decode state holds raw running sums (G, C grow with every token). A prefill under bf16 autocast once
    returned them in bf16 (its einsums ran in the autocast dtype), and every later step added to them in bf16: a
    few hundred tokens on, the sums stopped taking in new tokens and the decode drifted 0.3 from forward."""
    m = make("ska")
    T, N = 8, 300
    x = torch.randn(1, T + N, D_MODEL)
    fresh = m.init_state(1)
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, state = m.prefill(x[:, :T])
            wrong = {k: v.dtype for k, v in state.items() if v.dtype != fresh[k].dtype}
            ys = []
            for t in range(T, T + N):
                y_t, state = m.step(x[:, t], state)
                ys.append(y_t.float())
    err = rel(torch.stack(ys, 1)[:, -50:], ref[:, -50:])
    assert err < AUTOCAST_DECODE_RTOL, f"ska: decode after an autocast prefill vs fp32 forward: rel err {err:.2e}"
    assert not wrong, f"ska: prefill under autocast returned state dtypes {wrong}, init_state's are fp32"


def test_kronecker_slots_state_dtypes_agree_in_a_16_bit_model():
    """The convolution buffer of the slot memory holds the address logits, computed in at least fp32: prefill and
    step return it so, and init_state must lay it out alike."""
    for dtype in (torch.bfloat16, torch.float16):
        m = make("kronecker_slots", dtype)
        x = torch.randn(2, 5, D_MODEL, dtype=dtype)
        with torch.no_grad():
            _, pre = m.prefill(x[:, :4])
            _, stepped = m.step(x[:, 4], m.init_state(2, dtype=dtype))
        fresh = m.init_state(2, dtype=dtype)
        for key in fresh:
            assert fresh[key].dtype == pre[key].dtype == stepped[key].dtype, (
                f"kronecker_slots ({dtype}): state[{key!r}] init_state {fresh[key].dtype}, prefill "
                f"{pre[key].dtype}, step {stepped[key].dtype}")
