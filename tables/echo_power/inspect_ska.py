"""Inspect the trained SKA layers of an ablation's checkpoints: the learned spectral gain gamma per head and
the top singular value sigma of the whitened lag-one operator A_w on test sequences (is the
normalisation A = clamp(gamma, 1, gamma_max) A_w / max(sigma, 1) active?).

    zoo ablate recipes/ablations/echo_power.yaml --out /tmp/echo_power --no-progress
    python tables/echo_power/inspect_ska.py /tmp/echo_power

Assumes masked prefix-mode SKA as the model's layer 1 (the echo recipes); the statistics and the
whitening are the kernel's own (``ska_final_state``, ``whitened_operator``), with the seq_max key scale.
"""
import glob
import sys
from pathlib import Path

import torch

from kernels.ska.chunked import ska_final_state
from kernels.ska.operator import whitened_operator
from zoo import build_task
from zoo.reevaluate import eval_recipe, load_model
from zoo.training.checkpoint import load


def whitened_lag_sigma(k: torch.Tensor, w: torch.Tensor, ridge: float) -> torch.Tensor:
    """Top singular value (exact, not the kernel's power-iteration estimate) of ``A_w = L^-1 M L^-T`` per
    (sequence, head), from the statistics a prefill of keys ``k`` (B, T, H, r) under mask ``w`` builds."""
    state = ska_final_state(k, torch.zeros_like(k), w)
    s2 = state["s"].clamp_min(1e-6)[..., None, None] ** 2  # seq_max key scale, squared
    G = state["G"] / s2 + ridge * torch.eye(k.shape[-1])
    _, A_w = whitened_operator(G, state["M"] / s2)
    return torch.linalg.matrix_norm(A_w, ord=2)


def main(folders):
    torch.set_num_threads(1)
    for folder in folders:
        for path in sorted(glob.glob(f"{folder}/checkpoints/*/checkpoint.pt")):
            state = load(Path(path))
            recipe, _ = eval_recipe(state["recipe"], state.get("imports", []))
            model = load_model(state, recipe, torch.device("cpu")).eval()
            ska = model.blocks[1].mixer
            data = build_task(recipe).make("test", seed=recipe.seed, num_examples=200)
            seen = {}
            hook = ska.register_forward_pre_hook(lambda m, a, kw: seen.update(x=a[0]), with_kwargs=True)
            with torch.no_grad():
                model(data.inputs, data.mask)
                hook.remove()
                _, k, _ = ska._qkv(seen["x"])
                sigma = whitened_lag_sigma(k, data.mask.float(), ska.options.ridge)
            q = torch.quantile(sigma, torch.tensor([0.1, 0.5, 0.9]), dim=0)  # (3, H)
            task = state["recipe"]["task"]
            print(f"power {ska.options.power} pairs {task['num_kv_pairs']} gap {task.get('value_gap', 0)} "
                  f"lr {recipe.train.lr:g} gamma_max {ska.options.gamma_max:g} seed {recipe.seed}: "
                  f"gamma {[round(g, 3) for g in ska.gamma.tolist()]}, sigma p10/p50/p90 per head "
                  + " | ".join("/".join(f"{v:.2f}" for v in q[:, h].tolist()) for h in range(q.shape[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
