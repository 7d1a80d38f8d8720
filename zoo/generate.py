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

Test-time knobs (:attr:`mixers.Mixer.test_time_knobs`: GKA's ``num_iter``, SKA's ``power``, ...) take the values
of the checkpoint recipe's ``eval.test_time``, the values its ``val_bpb`` and accuracies were measured under, so
what ``zoo generate`` decodes is what the tables scored. ``--test-time KNOB=VALUE`` (repeatable; the value read
as YAML, as an override is) changes one knob over the recipe's; a knob no layer of the model declares, or a
value the option refuses, is refused in one line naming the knob and the layers that declare knobs, as the
recipe's ``eval.test_time`` is. The same values reach every other consumer of a checkpoint through
:func:`load_lm` and :func:`resolve_test_time`: the lm-evaluation-harness adapter (:mod:`zoo.lm_harness`) and
``zoo export`` (:mod:`zoo.hf.export`, which writes them into the exported config).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import yaml

from mixers import MIXERS, Mixer
from mixers.options import OptionError, build_options, nearest, plain_options

from .data.prepare import same_tokenizer
from .errors import UserError
from .host_memory import peak_rss_mib
from .recipes.loading import misread_value
from .reevaluate import checkpoint_recipe, load_model, with_backends
from .tasks import Task
from .threads import MAX_THREADS
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


#: how a file that ``torch.save`` wrote starts: a zip archive, or a pickle (the older format)
_CHECKPOINT_STARTS = (b"PK\x03\x04", b"\x80")


def _is_text(path: Path) -> bool:
    """Whether the regular file ``path`` starts with UTF-8 text (a recipe, results rows), not a checkpoint."""
    try:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if not head or head.startswith(_CHECKPOINT_STARTS) or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.start >= len(head) - 3   # only a character the read cut in two
    return True


def refuse_text_file(path: Path, command: str) -> None:
    """Refuse a text file given where a checkpoint is read, naming what it is and what to give instead: a recipe
    (``.yaml``) or results rows (``results.jsonl``) would otherwise fail to unpickle, in words naming neither. A
    file named as a checkpoint (``*.pt``) is left to the checkpoint reader, which reports it damaged."""
    if path.suffix == ".pt" or not _is_text(path):
        return
    if path.suffix in (".yaml", ".yml"):
        raise UserError(f"{command}: {path} is a recipe, not a checkpoint; train it first (zoo train {path} --out DIR),"
                        f" then give DIR")
    beside = path.parent / ckpt.FILENAME
    hint = (f"give {beside} (or its folder {path.parent})" if beside.is_file() else
            f"give a {ckpt.FILENAME} (zoo train RECIPE --out DIR writes DIR/{ckpt.FILENAME}) or the folder holding it")
    raise UserError(f"{command}: {path} is a text file, not a checkpoint; {hint}")


def read_lm(location, imports: list[str] = (), tokenizer: str = "", command: str = "zoo generate"):
    """``(path, state, recipe, task)`` of a language-model checkpoint (a file or its folder), checked."""
    path = ckpt.path_in(location)
    refuse_text_file(path, command)
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
    if tokenizer and not same_tokenizer(recipe.task.options.tokenizer, tokenizer):
        raise UserError(f"{path}: trained with tokenizer {recipe.task.options.tokenizer!r}, not {tokenizer!r}; "
                        f"generate with the checkpoint's own tokenizer (leave out --tokenizer)")
    rows = state["model"]["embed.weight"].shape[0]
    if rows != task.vocab_size:
        raise UserError(f"{path}: the model has a vocabulary of {rows} tokens but its tokenizer "
                        f"{recipe.task.options.tokenizer!r} now has {task.vocab_size}; use the tokenizer it was "
                        f"trained with")
    ckpt.check_same_tokenizer(path, state, task)
    return path, state, recipe, task


#: how a consumer names a ``--test-time`` item in its refusals: the command line's flag
TEST_TIME_FLAG = "zoo generate: --test-time {}"


def parse_test_time(given, where: str = TEST_TIME_FLAG) -> list[tuple[str, Any, str]]:
    """``(knob, value, how it was written)`` of each test-time override: ``given`` is a mapping ``{knob: value}``
    or texts ``KNOB=VALUE`` whose value is read as YAML (as a recipe override's). ``where`` formats the refusal's
    prefix from the item (``"zoo generate: --test-time {}"``)."""
    if isinstance(given, Mapping):
        return [(str(knob), value, where.format(f"{knob}={value!r}")) for knob, value in given.items()]
    items = []
    for text in given or ():
        knob, eq, value_text = str(text).partition("=")
        knob = knob.strip()
        if not eq or not knob or "." in knob or not knob.isidentifier():
            raise UserError(f"{where.format(text)}: expected KNOB=VALUE, one test-time knob and its value (e.g. "
                            f"num_iter=10)")
        try:
            value = yaml.safe_load(value_text) if value_text.strip() else None
        except (yaml.YAMLError, RecursionError, ValueError):
            raise UserError(f"{where.format(text)}: the value {value_text!r} is not valid YAML") from None
        why = misread_value(value_text)
        if why is not None:
            raise UserError(f"{where.format(text)}: {why}")
        items.append((knob, value, where.format(text)))
    return items


def _layers_of(source) -> list[tuple[str, type, Any]]:
    """``(name, mixer class, options)`` of every layer of a resolved recipe or a :class:`zoo.model.HybridLM`."""
    if hasattr(source, "blocks"):
        return [(type(b.mixer).name, type(b.mixer), b.mixer.options) for b in source.blocks]
    return [(spec.name, MIXERS.get(spec.name), spec.options) for spec in source.layers]


def describe_knobs(source) -> str:
    """The test-time knobs of a recipe's or model's layers with the mixers that declare them, for a refusal."""
    owners: dict[str, list[str]] = {}
    for name, cls, _options in _layers_of(source):
        for knob in cls.test_time_knobs:
            owners.setdefault(knob, [])
            if name not in owners[knob]:
                owners[knob].append(name)
    if not owners:
        layers = ", ".join(dict.fromkeys(name for name, _c, _o in _layers_of(source)))
        return f"none of its layers ({layers}) declares a test-time knob"
    return "the knobs its layers declare: " + ", ".join(f"{k} ({', '.join(v)})" for k, v in sorted(owners.items()))


def check_test_time(source, items: Iterable[tuple[str, Any, str]]) -> dict[str, Any]:
    """``{knob: value}`` of ``items`` (:func:`parse_test_time`), checked against the layers of ``source`` (a
    resolved recipe or a model) as the recipe's ``eval.test_time`` is: some layer declares the knob, and every
    layer that declares it accepts the value as the option it overrides."""
    layers = _layers_of(source)
    own = sorted({k for _n, cls, _o in layers for k in cls.test_time_knobs})
    out = {}
    for knob, value, written in items:
        if knob not in own:
            raise UserError(f"{written}: no layer of this model declares a test-time knob {knob!r}"
                            f"{nearest(knob, own)} ({describe_knobs(source)})")
        for name, cls, options in layers:
            if knob in cls.test_time_knobs:
                try:
                    build_options(type(options), {**plain_options(options), knob: value}, "")
                except OptionError as err:
                    raise UserError(f"{written}: {value!r} is not a valid {knob} for {name}: {err.message}") from None
        out[knob] = value
    return out


def resolve_test_time(recipe, given=(), where: str = TEST_TIME_FLAG) -> dict[str, Any]:
    """The test-time knob values a consumer of a checkpoint trained with ``recipe`` uses: the recipe's
    ``eval.test_time`` (what its metrics were measured under), with ``given`` (:func:`parse_test_time`)
    over it, checked. A knob of the recipe's that no layer declares (a grid's ``eval.test_time`` reaches
    every cell, and only some cells declare it) changes nothing and is left out."""
    own = {k for _n, cls, _o in _layers_of(recipe) for k in cls.test_time_knobs}
    recorded = {k: v for k, v in recipe.eval.test_time.items() if k in own}
    return {**recorded, **check_test_time(recipe, parse_test_time(given, where))}


def apply_test_time(model, values: Mapping[str, Any]) -> None:
    """Set the test-time knob ``values`` on every layer of ``model`` (a :class:`zoo.model.HybridLM`) for good,
    as :meth:`zoo.model.HybridLM.test_time` sets them inside its context (each mixer takes the knobs it declares;
    they apply while the model is in eval mode). A value one layer refuses changes no layer."""
    model.set_test_time(values)


def load_lm(location, device="cpu", imports: list[str] = (), tokenizer: str = "", test_time=(),
            where: str = TEST_TIME_FLAG, command: str = "zoo generate", backends=()):
    """``(model, task)`` of a language-model checkpoint (a file or its folder), in eval mode, its test-time knobs
    set to the recipe's ``eval.test_time`` with ``test_time`` (``{knob: value}`` or ``KNOB=VALUE`` texts) over it
    (:func:`resolve_test_time`; ``where`` names an override in a refusal, ``command`` the caller in the others), its
    layers with the kernel backends ``backends`` choose (``model.mixer_options.gla.backend=torch``: a model trained
    with ``backend: triton`` on a GPU decodes on a CPU; no other override)."""
    model, task, _values = _load_lm(location, device, imports, tokenizer, test_time, where, command, backends)
    return model, task


def _load_lm(location, device, imports, tokenizer, test_time, where, command="zoo generate", backends=()):
    path, state, recipe, task = read_lm(location, imports, tokenizer, command)
    values = resolve_test_time(recipe, test_time, where)
    built = with_backends(state["recipe"], list(imports), backends, command) or recipe
    model = load_model(state, built, torch.device(device), path)
    apply_test_time(model, values)
    return model, task, values


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


#: seeds the CPU generator tells apart: it keeps a seed's lowest 32 bits (2**32 samples as 0 does)
SEEDS = range(2 ** 32)


def check_seed(seed: int, who: str) -> None:
    """Refuse a sampling seed the generator would not tell from another (:data:`SEEDS`)."""
    if seed not in SEEDS:
        raise UserError(f"{who} {seed}: must be in 0 .. 2**32 - 1 (the sampling generator keeps a seed's lowest "
                        f"32 bits, so {seed} would sample as {seed % 2 ** 32} does)")


def check_sampling(temperature: float, top_k: int, top_p: float, who: str = "generate_ids") -> None:
    """Refuse, in one line naming the argument, sampling arguments :func:`sample` cannot draw with: a ``top_p``
    outside (0, 1] (at 0 no token is kept and the draw fails in words naming neither), a negative ``top_k``, a
    NaN or infinite ``temperature`` (every probability NaN, or every token alike however the model ranks them)."""
    for name, value, ok, wanted in (
            ("temperature", temperature, math.isfinite(temperature), "must be a finite number (0 or less: greedy)"),
            ("top_k", top_k, top_k >= 0, "must be >= 0 (0: every token)"),
            ("top_p", top_p, 0 < top_p <= 1, "must be in (0, 1]")):
        if not ok:
            raise UserError(f"{who}: {name}={value!r}: {wanted}")


@torch.no_grad()
def generate_ids(model, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
                 stop=None) -> tuple[list[int], float, float]:
    """``(new ids, prefill seconds, decode seconds)``: ``prefill`` on the prompt, then ``step`` per token; at most
    ``max_new_tokens`` ids (none for 0), ending early at ``eos_id`` or once ``stop(ids so far)`` is true. An empty
    ``prompt`` (no logits to draw the first token from: start from EOS, as :func:`generate_text` does) and sampling
    arguments out of range (:func:`check_sampling`) are refused in one line."""
    check_sampling(temperature, top_k, top_p)
    check_seed(seed, "generate_ids: seed")
    if max_new_tokens <= 0:
        return [], 0.0, 0.0
    if len(prompt) == 0:
        raise UserError("generate_ids: an empty prompt (0 tokens) gives no logits to draw the first new token from; "
                        "start from the EOS token ([tokenizer.eos_id]), as zoo generate starts an empty prompt")
    was_training = model.training   # a model fresh from training: decode as evaluated (test-time knobs apply)
    model.eval()
    try:
        return _generate_ids(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, eos_id, stop)
    finally:
        model.train(was_training)


def _generate_ids(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, eos_id, stop):
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


def continuation_text(tok, prompt: list[int], new: list[int]) -> str:
    """The text the ids ``new`` (EOS left out) add after the ids ``prompt``: decoded after the prompt, since a token
    decoded alone can lose what it stands for after other text (a sentencepiece ``▁word`` its space)."""
    kept = [i for i in new if i != tok.eos_id]
    head, whole = tok.decode(prompt), tok.decode([*prompt, *kept])
    tail = whole[len(head):] if whole.startswith(head) else tok.decode(kept)
    return tail.decode("utf-8", errors="replace")


def generate_text(model, task, prompt: str, max_new_tokens: int = 200, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0) -> Generation:
    """``prompt`` continued: ``text`` is what the new ids add after it (``prompt + text`` is the whole text)."""
    tok = task.tokenizer
    ids = tok.encode(prompt) or [tok.eos_id]
    new, prefill_s, decode_s = generate_ids(model, ids, max_new_tokens, temperature, top_k, top_p, seed, tok.eos_id)
    return Generation(len(ids), new, continuation_text(tok, ids, new), prefill_s, decode_s)


def decode_notes(model) -> list[str]:
    """Each distinct line in which a layer of ``model`` says how its decoding (``prefill`` then ``step``) differs
    from its forward pass (:meth:`mixers.Mixer.decode_differs`); none where decoding reproduces the forward."""
    return [note for note in dict.fromkeys(m.decode_differs() for m in model.modules() if isinstance(m, Mixer))
            if note]


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: allocated on a CUDA device, else the resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mib()


def check_arguments(args) -> None:
    """Refuse, naming the flag and its value, a flag of ``zoo generate`` out of its range (a ``--test-time`` not
    written ``KNOB=VALUE``)."""
    for flag, value, ok, wanted in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "must be at least 1"),
            ("--temperature", args.temperature, 0 <= args.temperature < float("inf"),
             "must be a finite number >= 0 (0: greedy)"),
            ("--top-k", args.top_k, args.top_k >= 0, "must be >= 0 (0: every token)"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "must be in (0, 1]"),
            ("--threads", args.threads, 0 <= args.threads <= MAX_THREADS,
             f"must be a number of threads from 1 to {MAX_THREADS} (0: torch's default)")):
        if not ok:
            raise UserError(f"zoo generate: {flag} {value if isinstance(value, int) else format(value, 'g')}: "
                            f"{wanted}")
    check_seed(args.seed, "zoo generate: --seed")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("zoo generate: --device cuda: no CUDA device is available; use --device cpu (or auto)")
    parse_test_time(getattr(args, "test_time", None) or [])  # its syntax; the knobs are checked on the recipe


def run(args) -> int:
    """The ``zoo generate`` command."""
    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, task, values = _load_lm(args.checkpoint, device, args.imports or [], args.tokenizer, args.test_time or [],
                                   TEST_TIME_FLAG, backends=args.overrides or [])
    if values:
        source = " and --test-time" if args.test_time else "; --test-time KNOB=VALUE changes one"
        print(f"zoo generate: test-time knobs {', '.join(f'{k}={v!r}' for k, v in sorted(values.items()))} (the "
              f"recipe's eval.test_time{source})", file=sys.stderr)
    for note in decode_notes(model):
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
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="a mixer's kernel backend, e.g. model.mixer_options.gla.backend=torch to decode on a CPU a "
                        "model trained with backend: triton (no other override)")
    p.add_argument("--prompt", action="append", help="text to continue (repeat for several prompts; default: the "
                                                      "empty prompt)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8; 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set reaching p")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--tokenizer", default="", help="refuse unless the checkpoint was trained with this tokenizer")
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                   help="where to decode (default cpu; auto: cuda when available)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--imports", nargs="*", help="modules defining out-of-tree components the checkpoint uses")
    p.add_argument("--test-time", action="append", metavar="KNOB=VALUE",
                   help="a test-time knob's value over the recipe's eval.test_time, which applies by default "
                        "(repeat for several knobs; e.g. --test-time num_iter=10)")
