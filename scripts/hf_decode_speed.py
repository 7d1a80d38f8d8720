"""Time per generated token of the exported transformers model (``generate`` on a ZooCache) after a 1K- and a
16K-token prompt, next to the zoo's own decoding (``zoo generate``: prefill, then step) of the same model.

A linear-state mixer carries a state of fixed size, so its time per token should not grow with the prompt;
attention's KV cache does. The models are untrained two-layer byte models of the lm_bytes shape (d_model 64,
SwiGLU; weights do not change the cost), the prompt is Python's own help text (no download), greedy, one
thread by default. The transformers time of a token is the gap between two calls of a stopping criterion,
which ``generate`` calls once per new token; the zoo's is the time of a ``step`` and its greedy choice. The
median over the new tokens is taken, and the least of
``--repeats`` runs, the two prompts taking turns, is reported (the machine may be shared). Prints a Markdown table.

    python scripts/hf_decode_speed.py [--mixers gla mamba2 attention] [--lengths 1024 16384] [--new 64]
"""
from __future__ import annotations

import argparse
import pydoc_data.topics
import statistics
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import zoo
from zoo.hf import ZooConfig, ZooForCausalLM
from zoo.hf.model import CACHE_FIELD

OPTIONS = {"attention": {"n_heads": 2}, "gla": {"n_heads": 2, "head_dim": 32, "chunk_size": 64},
           "gated_deltanet": {"n_heads": 2, "head_dim": 32, "chunk_size": 64},
           "mamba2": {"d_state": 16, "headdim": 32, "chunk_size": 64}}


class Clock(StoppingCriteria):
    """Records the time of every call (one per generated token); never stops generation."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def model_for(mixer: str) -> ZooForCausalLM:
    recipe = zoo.load({"model": {"d_model": 64, "layers": [mixer, mixer], "mixer_options": {mixer: OPTIONS.get(mixer, {})}},
                       "task": {"name": "lm", "seq_len": 2048}})
    config = ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, vocab_size=257, eos_token_id=256, pad_token_id=256)
    return ZooForCausalLM(config, hybrid=zoo.build_model(recipe).eval()).eval()


def ms_per_token(model: ZooForCausalLM, prompt: list[int], new: int) -> tuple[float, float, int]:
    """``(transformers ms/token, zoo generate ms/token, cache elements at the end)``."""
    clock = Clock()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([clock]), return_dict_in_generate=True)
    hf = 1000 * statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))
    return hf, zoo_ms_per_token(model.zoo, prompt, new), getattr(out, CACHE_FIELD).state_elements()


@torch.no_grad()
def zoo_ms_per_token(model, prompt: list[int], new: int) -> float:
    """The median time of one ``step`` and its greedy choice, as ``zoo generate`` decodes (``generate_ids``)."""
    logits, states = model.prefill(torch.tensor([prompt]))
    token, times = int(logits[0, -1].argmax()), []
    for _ in range(new - 1):
        start = time.perf_counter()
        logits, states = model.step(torch.tensor([token]), states)
        token = int(logits[0].argmax())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def best(model: ZooForCausalLM, prompts: list[list[int]], new: int, repeats: int) -> list[tuple[float, float, int]]:
    """Per prompt, the fastest of ``repeats`` runs; the prompts take turns, so a busy spell of a shared machine
    falls on every length alike."""
    runs = [[ms_per_token(model, prompt, new) for prompt in prompts] for _ in range(repeats)]
    return [(min(r[i][0] for r in runs), min(r[i][1] for r in runs), runs[0][i][2]) for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", nargs="+", default=["gla", "gated_deltanet", "mamba2", "attention"])
    parser.add_argument("--lengths", nargs=2, type=int, default=[1024, 16384])
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt; the fastest is reported")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = list("".join(pydoc_data.topics.topics.values()).encode())
    short, long = args.lengths
    print(f"| mixer | transformers ms/token, {short} | {long} | {long} / {short} | zoo generate ms/token, {short} "
          f"| {long} | cache elements, {short} | {long} |")
    print("|---|---|---|---|---|---|---|---|")
    for mixer in args.mixers:
        model = model_for(mixer)
        model.generate(torch.tensor([text[:16]]), max_new_tokens=2)  # first-call costs out of the way
        (a, za, ea), (b, zb, eb) = best(model, [text[:short], text[:long]], args.new, args.repeats)
        print(f"| {mixer} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {za:.2f} | {zb:.2f} | {ea:,} | {eb:,} |", flush=True)


if __name__ == "__main__":
    main()
