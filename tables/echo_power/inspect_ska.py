"""Inspect the trained SKA layers of an ablation's checkpoints: the learned spectral gain gamma per head and
the top singular value sigma of the whitened lag-one operator A_w on test sequences (is the
normalisation A = clamp(gamma, 1, gamma_max) A_w / max(sigma, 1) active?).

    zoo ablate recipes/ablations/echo_power.yaml --out /tmp/echo_power --no-progress
    python tables/echo_power/inspect_ska.py /tmp/echo_power

Assumes masked prefix-mode SKA as the model's layer 1 (the echo recipes); sigma is computed from the
same statistics as kernels/ska/reference.py (seq_max key scale over the masked tokens).
"""
import glob
import sys
from pathlib import Path

import torch

from zoo.checkpoint import load
from zoo.evaluation import eval_recipe, load_model
from zoo.train import build_task


def whitened_lag_sigma(k: torch.Tensor, w: torch.Tensor, ridge: float) -> torch.Tensor:
    """Top singular value of L^-1 M L^-T per (sequence, head); k (B, T, H, r), w (B, T) 0/1 mask."""
    w = w[..., None]
    scale = (k.norm(dim=-1) * w).amax(dim=1).clamp_min(1e-6)
    kn = k / scale[:, None, :, None]
    G = torch.einsum("bth,bthr,bths->bhrs", w, kn, kn) + ridge * torch.eye(k.shape[-1])
    M = torch.einsum("bth,bthr,bths->bhrs", w[:, 1:] * w[:, :-1], kn[:, 1:], kn[:, :-1])
    L = torch.linalg.cholesky(G)
    A = torch.linalg.solve_triangular(L, M, upper=False)
    A = torch.linalg.solve_triangular(L, A.transpose(-1, -2), upper=False).transpose(-1, -2)
    return torch.linalg.matrix_norm(A, ord=2)


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
