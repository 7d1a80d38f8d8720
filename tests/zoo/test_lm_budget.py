"""The language-model budgets of a GPU speed report against hand computations: attention's step split into its
attention kernels and the shared rest, each model's mixer time and budget, and a budget met exactly when the
documented target's verdict on the same steps is met."""
import json
from pathlib import Path

import pytest
import torch

from zoo.benchmark import gpu_report
from zoo.benchmark.gpu_targets import MET, Limits, checks
from zoo.benchmark.lm_budget import length_budget

RUN = Path(__file__).resolve().parents[2] / "tables" / "bench-gpu-h200" / "8ed3e8f"
ATTENTION_NAMES = ["cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26",
                   "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "_rotate",
                   "flash_fwd_kernel", "fmha_cutlassB_bf16_aligned_64x64_k128_sm80",
                   "aten::_scaled_dot_product_flash_attention_for_cpu"]
OTHER_NAMES = ["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "_rms_bwd", "_conv_bwd", "_fwd_prep",
               "at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>", "_jordan_fwd"]


def _ms() -> float:
    return round(0.05 + 3 * float(torch.rand(())), 4)


def _kernels(names):
    return [{"name": name, "calls": int(torch.randint(1, 20, ())), "ms": _ms()} for name in names]


def _pick(names, k):
    return [names[i] for i in torch.randperm(len(names))[:k].tolist()]


def test_budgets_split_attention_step_and_follow_the_target_verdict():
    for _ in range(200):
        T, target = int(torch.randint(64, 9000, ())), 0.5 + 1.5 * float(torch.rand(()))
        own = _kernels(_pick(ATTENTION_NAMES, int(torch.randint(1, 4, ()))))
        others = _kernels(_pick(OTHER_NAMES, int(torch.randint(1, 5, ()))))
        attention_ms = sum(k["ms"] for k in own + others) + _ms()
        rows = [{"mixer": "attention", "T": T, "step_device_ms": attention_ms, "step_kernels": own + others},
                {"mixer": "attention", "T": T + 1, "step_device_ms": 99.0, "step_kernels": own}]
        steps = {name: attention_ms * (0.3 + 2 * float(torch.rand(()))) for name in ("a", "b", "c")}
        rows += [{"mixer": name, "T": T, "step_device_ms": ms} for name, ms in steps.items()]
        rows.append({"mixer": "d", "T": T, "error": "OOM"})
        found = length_budget(rows, T, target, "attention", ["a", "b", "c", "d"])

        shared = sum(k["ms"] for k in others) + (attention_ms - sum(k["ms"] for k in own + others))
        assert found.attention_own_ms == pytest.approx(sum(k["ms"] for k in own), rel=1e-12)
        assert found.shared_ms == pytest.approx(shared, rel=1e-12)
        assert found.ceiling == pytest.approx(attention_ms / shared, rel=1e-12)
        assert [m.mixer for m in found.mixers] == ["a", "b", "c"]       # a row without a step is left out
        verdicts = {c.target: c.status for c in checks(_summary(T, attention_ms, steps), limits=Limits(lm_long=target))}
        for m in found.mixers:
            assert m.mixer_ms == pytest.approx(steps[m.mixer] - shared, rel=1e-12)
            assert m.budget_ms == pytest.approx(attention_ms / target - shared, rel=1e-12)
            assert m.fits == (verdicts[f"LM {m.mixer} / attention, T {T}"] == MET)
            if m.fits:
                assert m.cut == 0
            else:   # the cut brings the mixers to the budget (to nothing where even that is too slow)
                assert m.mixer_ms * (1 - m.cut) == pytest.approx(max(m.budget_ms, 0.0), abs=1e-9)


def _summary(T: int, attention_ms: float, steps: dict) -> dict:
    """A summary of the models' ratios to attention at ``T`` (a shorter length's met by a wide margin)."""
    return {"card": "c", "commit": "x", "kernel_vs_fla": {"delta_rule": {}}, "layer_vs_sdpa": {}, "launches": {},
            "first_call_s": {},
            "lm_vs_attention": {name: {"1": 100.0, str(T): attention_ms / ms} for name, ms in steps.items()}}


def test_a_length_without_a_profiled_attention_step_or_its_kernels_says_why():
    kernels = _kernels(OTHER_NAMES[:3])
    rows = [{"mixer": "attention", "T": 64, "step_device_ms": 5.0, "step_kernels": kernels},
            {"mixer": "attention", "T": 128, "error": "OOM"}, {"mixer": "a", "T": 64, "step_device_ms": 6.0}]
    assert "no attention kernel named" in length_budget(rows, 64, 0.9, "attention", ["a"])
    assert "no profiled step of the attention model at T 128" == length_budget(rows, 128, 0.9, "attention", ["a"])


def test_the_h200_run_report_splits_its_steps_as_its_kernels_say():
    """The committed H200 run (8ed3e8f): attention's attention kernels at T 8192 are its two cuDNN SDPA kernels and
    the rotary embedding's, 2.8511 + 1.0945 + 0.2738 ms of its 8.579 ms step (read off its lm.json by hand)."""
    env, lm = (json.loads((RUN / f"{name}.json").read_text()) for name in ("env", "lm"))
    about, columns, body = gpu_report._budget_section(lm, env["plan"], env["linear"])
    shared = 8.579 - (2.8511 + 1.0945 + 0.2738)
    assert f"T 8192: attention's step 8.58 ms, its attention kernels 4.22 ms, shared {shared:.3g} ms" in about
    assert f"ceiling {8.579 / shared:.3g}x (target 1.5x)" in about
    jordan = dict(zip(columns, next(r for r in body if r[0] == "jordan")))
    assert jordan["T 8192: mixer ms"] == f"{6.096 - shared:.3g}"
    assert jordan["T 8192: budget ms"] == f"{8.579 / 1.5 - shared:.3g}"
    assert jordan["T 2048: cut"] == "fits"      # its measured ratio at T 2048 met the 0.9 target


def test_a_target_above_the_ceiling_leaves_no_mixer_a_budget():
    """Attention's step 10 ms, 1 ms of it SDPA's: a free mixer reaches 10 / 9 = 1.11x, short of the 1.5x target
    at the longer length (budget 10 / 1.5 - 9 < 0), while the 0.9x one at the shorter length leaves 10 / 0.9 - 9."""
    sdpa = {"name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "calls": 4, "ms": 1.0}
    rows = [{"mixer": "attention", "T": T, "step_device_ms": 10.0, "step_kernels": [sdpa]} for T in (512, 2048)]
    rows += [{"mixer": "a", "T": T, "step_device_ms": 9.5} for T in (512, 2048)]
    about, columns, body = gpu_report._budget_section({"rows": rows}, {"lm_lengths": [2048, 512]}, ["a"])
    assert "T 2048: attention's step 10 ms, its attention kernels 1 ms, shared 9 ms, ceiling 1.11x (target 1.5x, " \
           "above the ceiling)" in about and "ceiling 1.11x (target 0.9x)" in about
    cells = dict(zip(columns, body[0]))
    assert cells["T 2048: budget ms"] == f"{10 / 1.5 - 9:.3g}" and cells["T 2048: cut"] == "no mixer fits"
    assert cells["T 512: budget ms"] == f"{10 / 0.9 - 9:.3g}" and cells["T 512: cut"] == "fits"
