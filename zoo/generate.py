"""``zoo generate CHECKPOINT --prompt TEXT``: text from a trained language model, decoded through the
recurrent form of its mixers.

The prompt goes through ``prefill`` (the parallel form, which also returns every layer's decode state),
then each new token through ``step``: a linear-state mixer carries a state of fixed size, attention
its growing KV cache, so the time per new token shows the difference. Sampling: ``temperature`` 0 is
greedy (argmax); otherwise logits / temperature, restricted to the ``top_k`` most likely tokens and the
smallest set whose probability reaches ``top_p``, drawn with a generator seeded by ``seed``. An empty
prompt starts from EOS. Several prompts of different lengths are decoded one after another, each with
its own state (a padded batch would mix padding into the recurrent states). Decoding stops at
``max_new_tokens`` or at EOS. A flag out of its range, or ``--device cuda`` without a CUDA device, is refused
in one line naming the flag and its value, before the checkpoint is read.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch

from mixers import Mixer

from .errors import UserError
from .reevaluate import checkpoint_recipe, load_model
from .tasks import Task
from .training import checkpoint as ckpt
from .training.device import resolve_device


@dataclass
class Generation:
    prompt_tokens: int
    ids: list[int]
    text: str
    prefill_seconds: float
    decode_seconds: float

    @property
    def seconds_per_token(self) -> float:
        return self.decode_seconds / max(len(self.ids) - 1, 1)


def read_lm(location, imports: list[str] = (), tokenizer: str = "", command: str = "zoo generate"):
    """``(path, state, recipe, task)`` of a language-model checkpoint (a file or its folder), checked."""
    path = ckpt.path_in(location)
    state = ckpt.load(path)
    missing = sorted(set(state.get("imports", [])) - set(imports))
    if missing:  # importing runs code: only what the user names
        raise UserError(f"{path}: trained with components defined in {missing}; name them with --imports if you "
                        f"trust them")
    recipe = checkpoint_recipe(path, state["recipe"], list(imports))
    ckpt.check_same_model(path, state, recipe.key)
    if recipe.task.name != "lm":
        raise UserError(f"{path}: trained on task {recipe.task.name!r}, not a language model (task: lm); {command} "
                        f"needs an lm checkpoint")
    task = Task.from_spec(recipe.task)
    if tokenizer and tokenizer != recipe.task.options.tokenizer:
        raise UserError(f"{path}: trained with tokenizer {recipe.task.options.tokenizer!r}, not {tokenizer!r}; "
                        f"generate with the checkpoint's own tokenizer (leave out --tokenizer)")
    rows = state["model"]["embed.weight"].shape[0]
    if rows != task.vocab_size:
        raise UserError(f"{path}: the model has a vocabulary of {rows} tokens but its tokenizer "
                        f"{recipe.task.options.tokenizer!r} now has {task.vocab_size}; use the tokenizer it was "
                        f"trained with")
    return path, state, recipe, task


def load_lm(location, device="cpu", imports: list[str] = (), tokenizer: str = ""):
    """``(model, task)`` of a language-model checkpoint (a file or its folder)."""
    path, state, recipe, task = read_lm(location, imports, tokenizer)
    return load_model(state, recipe, torch.device(device), path), task


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """One token id from ``(V,)`` logits."""
    if temperature <= 0:
        return int(logits.argmax())
    # shifted to a maximum of 0 before the division: a tiny temperature then sends the other logits to -inf (the
    # greedy choice) instead of overflowing every logit to +-inf, whose softmax is NaN
    logits = logits.double()
    logits = (logits - logits.max()) / temperature
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
                 stop=None) -> tuple[list[int], float, float]:
    """``(new ids, prefill seconds, decode seconds)``: ``prefill`` on the prompt, then ``step`` per token; at most
    ``max_new_tokens`` ids (none for 0), ending early at ``eos_id`` or once ``stop(ids so far)`` is true."""
    if max_new_tokens <= 0:
        return [], 0.0, 0.0
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    logits, states = model.prefill(torch.tensor([prompt], device=device))
    out = [sample(logits[0, -1].cpu(), temperature, top_k, top_p, generator)]
    prefilled = time.perf_counter()
    while len(out) < max_new_tokens and out[-1] != eos_id and not (stop is not None and stop(out)):
        logits, states = model.step(torch.tensor([out[-1]], device=device), states)
        out.append(sample(logits[0].cpu(), temperature, top_k, top_p, generator))
    return out, prefilled - start, time.perf_counter() - prefilled


def generate_text(model, task, prompt: str, max_new_tokens: int = 200, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0) -> Generation:
    tok = task.tokenizer
    ids = tok.encode(prompt) or [tok.eos_id]
    new, prefill_s, decode_s = generate_ids(model, ids, max_new_tokens, temperature, top_k, top_p, seed, tok.eos_id)
    text = tok.decode([i for i in new if i != tok.eos_id]).decode("utf-8", errors="replace")
    return Generation(len(ids), new, text, prefill_s, decode_s)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated on a CUDA device, else the resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check_arguments(args) -> None:
    """Refuse, naming the flag and its value, a flag of ``zoo generate`` out of its range."""
    for flag, value, ok, wanted in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "must be at least 1"),
            ("--temperature", args.temperature, 0 <= args.temperature < float("inf"),
             "must be a finite number >= 0 (0: greedy)"),
            ("--top-k", args.top_k, args.top_k >= 0, "must be >= 0 (0: every token)"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "must be in (0, 1]"),
            ("--threads", args.threads, args.threads >= 0, "must be a positive number of threads (0: torch's "
                                                           "default)")):
        if not ok:
            raise UserError(f"zoo generate: {flag} {value if isinstance(value, int) else format(value, 'g')}: "
                            f"{wanted}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("zoo generate: --device cuda: no CUDA device is available; use --device cpu (or auto)")


def run(args) -> int:
    """The ``zoo generate`` command."""
    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, task = load_lm(args.checkpoint, device, args.imports or [], args.tokenizer)
    for note in dict.fromkeys(m.decode_differs() for m in model.modules() if isinstance(m, Mixer)):
        if note:
            print(f"zoo generate: note: {note}", file=sys.stderr)
    for prompt in args.prompt or [""]:
        g = generate_text(model, task, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                          args.seed)
        print(prompt + g.text)
        print(f"[{g.prompt_tokens} prompt tokens in {g.prefill_seconds:.3f}s; {len(g.ids)} new tokens, "
              f"{len(g.ids) / max(g.prefill_seconds + g.decode_seconds, 1e-9):.1f} tokens/s, "
              f"{1000 * g.seconds_per_token:.2f} ms per decoded token; peak memory {peak_memory_mb(device):.0f} MB]",
              flush=True)
    return 0


def configure_parser(p) -> None:
    p.add_argument("checkpoint", help="a language-model checkpoint (zoo train recipes/lm/... --out DIR): file or DIR")
    p.add_argument("--prompt", action="append", help="text to continue (repeat for several prompts)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set reaching p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="", help="refuse unless the checkpoint was trained with this tokenizer")
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--imports", nargs="*", help="modules defining out-of-tree components the checkpoint uses")
