"""Seeded fuzzing of `zoo check` with malformed recipes and overrides.

Every generated case is malformed by construction (a value the recipe's declared types, ranges,
registries or YAML itself refuse), and every one must end the same way: exit code 2, exactly one line
on stderr starting ``zoo: error:``, no traceback, no code run from the recipe (a python-tag case would
create a marker file), within a per-case time limit. Cases run in this process through
``zoo.cli.main`` (a few hundred in seconds); a handful also run as real ``python -m zoo`` processes.

The generator is ``random.Random(seed)`` with the test's seed: a failure prints the seed
(``ZOO_TEST_SEED=<seed>`` replays it) and the failing cases with their files and arguments.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import os
import signal
import string
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from mixers import MIXERS, STATE_MIXERS
from zoo.cli import main
from zoo.config import EvalConfig, ModelConfig, RecipeConfig, TrainConfig
from zoo.tasks import TASKS

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
BASE = yaml.safe_load(TINY.read_text())
CASES = int(os.environ.get("ZOO_FUZZ_CASES", 420))  # generated cases per run (plus the fixed ones)
CASE_SECONDS = 20

KNOBS = sorted({k for n in MIXERS.names() for k in MIXERS.get(n).test_time_knobs})
REGISTERED = set(MIXERS.names()) | set(STATE_MIXERS.names()) | set(TASKS.names())


def fields_of(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata.get("range") or (None, None, None, None))
            for f in dataclasses.fields(cls) if f.init}


# section name -> (where it sits in the recipe, {field: (type, range)})
SECTIONS = {
    "top": ((), fields_of(RecipeConfig)),
    "model": (("model",), fields_of(ModelConfig)),
    "train": (("train",), fields_of(TrainConfig)),
    "eval": (("eval",), fields_of(EvalConfig)),
    "task": (("task",), {"name": (str, (None, None, None, None)), **fields_of(TASKS.get("mqar").Options)}),
    "attention": (("model", "mixer_options", "attention"), fields_of(MIXERS.get("attention").Options)),
    "mamba2": (("model", "mixer_options", "mamba2"), fields_of(MIXERS.get("mamba2").Options)),
    "layer0": (("model", "layers", 0, "attention"), fields_of(MIXERS.get("attention").Options)),
    "layer1_ska": (("model", "layers", 1, "ska"), fields_of(MIXERS.get("ska").Options)),
    "state_mixer": (("model", "state_mixer_options"), fields_of(STATE_MIXERS.get("swiglu").Options)),
}
EXTRA_TOP = {"extends", "imports"}
# sizes the mixer / task constructors refuse although their options declare no range
BAD_SIZES = {
    "attention": {"n_heads": [0, -1, -(10**18), 10**18]},
    "mamba2": {"d_state": [0, -3, 10**18], "headdim": [0, -1, 10**18], "expand": [0, -2, 10**18],
               "chunk_size": [0, -8]},
    "task": {"vocab_size": [0, -1, 10**18], "seq_len": [0, -1], "num_kv_pairs": [10**18]},
    "state_mixer": {"multiple_of": [0]},
}


class Case(typing.NamedTuple):
    kind: str
    files: dict  # name -> bytes; "recipe.yaml" is checked
    args: tuple  # overrides after the recipe

    def show(self) -> str:
        files = {k: v[:300] for k, v in self.files.items()}
        return f"[{self.kind}] args={[a[:200] for a in self.args]} files={files}"


# --------------------------------------------------------------------------------------- helpers
def dump(data) -> bytes:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode()


def flow(value) -> str:
    """A value as the YAML text of an override."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def put(data: dict, path: tuple, value) -> dict:
    """Set ``path`` in a copy of ``data``; a path through layers 0 makes it a one-key mapping."""
    data = copy.deepcopy(data)
    node = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            if isinstance(node[part], str):  # a plain layer name becomes {name: {options}}, of the named mixer
                node[part] = {path[i + 1]: {}}
        elif node.get(part) is None:
            node[part] = {}
        node = node[part]
    node[path[-1]] = value
    return data


def dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def recipe_case(rng, kind: str, path: tuple, value, yaml_only: bool = False) -> Case:
    """``value`` at ``path``, written in the file or (half of the time) as an override."""
    if yaml_only or rng.random() < 0.5:
        return Case(kind, {"recipe.yaml": dump(put(BASE, path, value))}, ())
    return Case(kind, {"recipe.yaml": TINY.read_bytes()}, (f"{dotted(path)}={flow(value)}",))


def typo(rng, word: str, taken: set) -> str:
    for _ in range(100):
        w = list(word)
        op = rng.randrange(6)
        i = rng.randrange(len(w))
        if op == 0 and len(w) > 1:
            del w[i]
        elif op == 1 and len(w) > 1:
            j = min(i + 1, len(w) - 1)
            w[i], w[j] = w[j], w[i]
        elif op == 2:
            w.insert(i, rng.choice(string.ascii_lowercase))
        elif op == 3:
            w[i] = rng.choice(string.ascii_lowercase + "_")
        elif op == 4:
            w = list(word.upper() if rng.random() < 0.5 else word.capitalize())
        else:
            w = list(word + rng.choice(["s", "_", "2", "x"]))
        out = "".join(w)
        if out and out not in taken and out.lower() not in {"yes", "no", "on", "off", "true", "false", "null", "y", "n"}:
            return out
    return word + "_unknown"


def base_kind(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return base_kind(args[0])[0], True
    return (origin or tp), False


# --------------------------------------------------------------------------------------- generators
def gen_misspelt_key(rng):
    name = rng.choice([*SECTIONS, "test_time"])
    if name == "test_time":
        key = typo(rng, rng.choice(KNOBS), set(KNOBS))
        return recipe_case(rng, "misspelt test-time knob", ("eval", "test_time", key), 1)
    where, fields = SECTIONS[name]
    taken = set(fields) | (EXTRA_TOP if name == "top" else set())
    key = typo(rng, rng.choice(sorted(fields)), taken)
    return recipe_case(rng, f"misspelt key in {name}", where + (key,), rng.choice([1, 4, "x", [1]]))


WRONG = {
    int: ["abc", 1.5, [1], {"a": 1}, True, "3"],
    float: ["fast", [1.0], {"a": 1}, True, "1e-3x"],
    bool: ["maybe", 1, 0, [True], {"a": 1}, "true"],
    str: [3, 1.5, [1], {"a": 1}, True],
    list: [3, "abc", {"a": 1}, 1.5],
    dict: [3, "abc", [1], 1.5],
}
EXOTIC = ["!!set {a: null}", "!!binary aGVsbG8=", "2001-12-14", "!!timestamp 2001-12-14t21:59:43.10-05:00"]


def gen_wrong_type(rng):
    name = rng.choice(list(SECTIONS))
    where, fields = SECTIONS[name]
    key = rng.choice(sorted(fields))
    kind, optional = base_kind(fields[key][0])
    if key in ("task", "grid") or kind is typing.Any:
        key, kind = "seed", int
        where = ()
    if dataclasses.is_dataclass(kind):
        kind = dict
    if kind is list and key in ("layers", "pattern"):
        choices = [3, "attention", {"a": 1}]  # a string is not a list of layers
    else:
        choices = WRONG.get(kind, WRONG[int])
    if rng.random() < 0.25:  # YAML types no option takes: sets, bytes, dates
        data = put(BASE, where + (key,), "@@EXOTIC@@")
        body = dump(data).decode().replace("'@@EXOTIC@@'", rng.choice(EXOTIC))
        return Case(f"exotic YAML value at {dotted(where + (key,))}", {"recipe.yaml": body.encode()}, ())
    value = rng.choice(choices)
    return recipe_case(rng, f"wrong type at {dotted(where + (key,))} ({kind.__name__})", where + (key,), value)


def out_of_range(rng, tp, bounds):
    """A number ``bounds`` refuse (or a non-finite float, which no option takes)."""
    at_least, above, at_most, below = bounds
    kind, _ = base_kind(tp)
    if kind is list:
        kind = typing.get_args(tp)[0]
    values = []
    if kind is float:
        values += [math.nan, math.inf, -math.inf]
    if at_least is not None:
        values += [at_least - 1, -(10**18) if kind is int else -1e308]
    if above is not None:
        values += [above, above - 1]
    if at_most is not None:
        values += [at_most + 1] + ([10**18] if kind is int and at_most < 10**18 else []) \
            + ([1e308] if kind is float and at_most < 1e308 else [])
    if below is not None:
        values += [below, below + 1]
    if kind is int:
        values = [int(v) for v in values if not (isinstance(v, float) and not math.isfinite(v))]
    return rng.choice(values) if values else None


def gen_bad_value(rng):
    if rng.random() < 0.35:  # sizes only a constructor or __post_init__ refuses
        name = rng.choice(sorted(BAD_SIZES))
        key = rng.choice(sorted(BAD_SIZES[name]))
        where = SECTIONS[name][0]
        return recipe_case(rng, f"bad size {name}.{key}", where + (key,), rng.choice(BAD_SIZES[name][key]))
    candidates = [(name, key) for name, (where, fields) in SECTIONS.items() for key, (tp, bounds) in fields.items()
                  if out_of_range(rng, tp, bounds) is not None]
    name, key = rng.choice(candidates)
    where, fields = SECTIONS[name]
    tp, bounds = fields[key]
    value = out_of_range(rng, tp, bounds)
    if typing.get_origin(tp) is list:
        good = {"betas": [0.9, 0.98], "seq_lens": [32]}.get(key, [1])
        value = good[:rng.randrange(len(good) + 1)] + [value] + good
    return recipe_case(rng, f"out of range {dotted(where + (key,))}={value!r}", where + (key,), value)


def gen_incompatible(rng):
    choice = rng.randrange(4)
    if choice == 0:  # d_model not divisible by the attention heads
        heads = rng.choice([2, 3, 4, 5, 8])
        d_model = heads * rng.randint(1, 40) + rng.randint(1, heads - 1)
        data = put(put(BASE, ("model", "d_model"), d_model), ("model", "mixer_options", "attention", "n_heads"), heads)
        return Case(f"d_model {d_model} vs n_heads {heads}", {"recipe.yaml": dump(data)}, ())
    if choice == 1:  # mamba2 heads do not tile d_model * expand
        headdim = 2 * BASE["model"]["d_model"] + rng.randint(1, 50)
        return recipe_case(rng, f"mamba2 headdim {headdim}", ("model", "mixer_options", "mamba2", "headdim"), headdim)
    if choice == 2:  # more key-value pairs than the sequence holds
        pairs = rng.randint(BASE["task"]["seq_len"] // 4 + 1, 1000)
        return recipe_case(rng, f"num_kv_pairs {pairs}", ("task", "num_kv_pairs"), pairs)
    data = copy.deepcopy(BASE)
    del data["model"]["layers"]
    data["model"]["pattern"] = ["attention"]
    if rng.random() < 0.5:
        data["model"]["n_layers"] = rng.choice([0, -1])
    return Case("pattern without a valid n_layers", {"recipe.yaml": dump(data)}, ())


def unknown_name(rng):
    if rng.random() < 0.6:
        return typo(rng, rng.choice(sorted(REGISTERED)), REGISTERED)
    name = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))
    return name if name not in REGISTERED else name + "_x"


def gen_unknown_name(rng):
    name = unknown_name(rng)
    place = rng.randrange(6)
    if place == 0:
        return recipe_case(rng, f"unknown mixer {name}", ("model", "layers", rng.randrange(2)), name)
    if place == 1:
        return recipe_case(rng, f"unknown mixer {name} with options", ("model", "layers"), [{name: {"n_heads": 2}}],
                           yaml_only=True)
    if place == 2:
        return recipe_case(rng, f"unknown state mixer {name}", ("model", "state_mixer"), name)
    if place == 3:
        return recipe_case(rng, f"unknown task {name}", ("task", "name"), name)
    if place == 4:
        return recipe_case(rng, f"unknown mixer_options.{name}", ("model", "mixer_options", name), {"n_heads": 2})
    data = copy.deepcopy(BASE)
    del data["model"]["layers"]
    data["model"].update(pattern=["attention", name], n_layers=4)
    return Case(f"unknown mixer {name} in a pattern", {"recipe.yaml": dump(data)}, ())


def gen_extends(rng):
    choice = rng.randrange(4)
    if choice == 0:  # a cycle of 1..4 files
        n = rng.randint(1, 4)
        names = ["recipe.yaml"] + [f"base{i}.yaml" for i in range(1, n)]
        files = {name: f"extends: {names[(i + 1) % n]}\n".encode() + (TINY.read_bytes() if i == n - 1 else b"")
                 for i, name in enumerate(names)}
        return Case(f"extends cycle of {n}", files, ())
    if choice == 1:
        return Case("extends a missing file", {"recipe.yaml": b"extends: missing_base.yaml\n" + TINY.read_bytes()}, ())
    if choice == 2:
        value = rng.choice(["3", "[base.yaml]", "{a: b}", "''", "."])
        return Case(f"extends: {value}", {"recipe.yaml": f"extends: {value}\n".encode() + TINY.read_bytes()}, ())
    chain = {"recipe.yaml": b"extends: mid.yaml\n", "mid.yaml": b"extends: gone.yaml\ntrain: {steps: 2}\n"}
    return Case("extends chain ends at a missing file", chain, ())


BROKEN = ["bad: [1, 2", "bad: {a: 1", "bad: 'unclosed", 'bad: "unclosed', "key: value: other", "bad: *undefined",
          "\tbad: 1", "bad: @at", "bad: `tick", "bad: [1, 2]]", "  - stray item", "bad: &a", "- list: item",
          "bad: !<!> x", "bad: }", "bad: ]", "%YAML 9.9", "bad: [a, {b: c]"]


def gen_yaml_syntax(rng):
    lines = TINY.read_text().splitlines()
    for _ in range(50):
        cut = rng.choice([i for i, line in enumerate(lines) if not line.startswith((" ", "#"))] + [len(lines)])
        text = "\n".join(lines[:cut] + [rng.choice(BROKEN)] + lines[cut:]) + "\n"
        try:
            yaml.safe_load(text)
        except yaml.YAMLError:
            return Case("YAML syntax error", {"recipe.yaml": text.encode()}, ())
    raise AssertionError("no syntax error generated")


BAD_BYTES = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\x80", b"\xed\xa0\x80"]


def gen_non_utf8(rng):
    raw = TINY.read_bytes()
    at = rng.randrange(len(raw) + 1)
    data = raw[:at] + rng.choice(BAD_BYTES) + raw[at:]
    with pytest.raises(UnicodeDecodeError):
        data.decode("utf-8")
    return Case(f"non-UTF-8 byte at {at}", {"recipe.yaml": data}, ())


def bomb_text(rng, flow_style: bool) -> str:
    width = rng.randint(2, 12)
    depth = math.ceil(math.log(200_000) / math.log(width)) + rng.randint(0, 2)
    if flow_style:
        parts = [f"&a0 [{', '.join(['1'] * width)}]"]
        parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth + 1)]
        return "[" + ", ".join(parts) + "]"
    lines = [f"b0: &b0 [{', '.join(['1'] * width)}]"]
    lines += [f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * width)}]" for i in range(1, depth + 1)]
    return "\n".join(lines)


SELF_REFERENCES = ["&a [*a]", "&a {x: *a}", "&a [1, [2, {k: *a}]]", "&a {x: [*a, 1]}"]


def gen_alias(rng):
    choice = rng.randrange(4)
    if choice == 0:
        return Case("alias bomb (file)", {"recipe.yaml": (bomb_text(rng, False) + "\n").encode() + TINY.read_bytes()}, ())
    if choice == 1:
        key = rng.choice(["description", "seed", "train.lr", "eval.seq_lens", "model.layers"])
        return Case("alias bomb (override)", {"recipe.yaml": TINY.read_bytes()}, (f"{key}={bomb_text(rng, True)}",))
    ref = rng.choice(SELF_REFERENCES)
    if choice == 2:
        key = rng.choice(["a", "description", "eval", "model"])
        text = TINY.read_text() if key == "a" else TINY.read_text().replace(f"\n{key}:", f"\nunused_{key}:")
        return Case("self-referencing alias (file)", {"recipe.yaml": (text + f"{key}: {ref}\n").encode()}, ())
    return Case("self-referencing alias (override)", {"recipe.yaml": TINY.read_bytes()},
                (f"{rng.choice(['seed', 'grid', 'model.layers'])}={ref}",))


def python_tags(marker: Path) -> list[str]:
    return [f'!!python/object/apply:os.system ["touch {marker}"]',
            f'!!python/object/apply:subprocess.check_call [["touch", "{marker}"]]',
            f'!!python/object/new:os.system ["touch {marker}"]',
            f'!python/object/apply:os.system ["touch {marker}"]',
            "!!python/name:os.system", "!!python/module:os",
            f'!!python/object/apply:builtins.exec ["open(\'{marker}\', \'w\')"]']


def gen_python_tag(rng, marker: Path):
    tag = rng.choice(python_tags(marker))
    choice = rng.randrange(4)
    if choice == 0:
        return Case("python tag (document)", {"recipe.yaml": f"--- {tag}\n".encode()}, ())
    if choice == 1:
        key = rng.choice(["seed", "description", "x"])
        text = TINY.read_text().replace(f"\n{key}:", f"\nold_{key}:") if key != "x" else TINY.read_text()
        return Case("python tag (top level)", {"recipe.yaml": (f"{key}: {tag}\n" + text).encode()}, ())
    if choice == 2:
        text = TINY.read_text().replace("d_model: 32", f"d_model: {tag}")
        return Case("python tag (nested)", {"recipe.yaml": text.encode()}, ())
    return Case("python tag (override)", {"recipe.yaml": TINY.read_bytes()},
                (f"{rng.choice(['train.lr', 'seed', 'model.layers.0'])}={tag}",))


def gen_deep(rng):
    depth = rng.choice([300, 990, 2500])
    opener, closer = rng.choice([("[", "]"), ("{a: ", "}")])
    value = opener * depth + "1" + closer * depth
    if rng.random() < 0.5:
        key = rng.choice(["seed", "description", "train.lr", "grid"])
        return Case(f"nested {depth} deep (override)", {"recipe.yaml": TINY.read_bytes()}, (f"{key}={value}",))
    if rng.random() < 0.5:
        text = TINY.read_text().replace("seed: 3", f"seed: {value}")
        return Case(f"nested {depth} deep (file)", {"recipe.yaml": text.encode()}, ())
    depth = rng.choice([150, 520])
    block = "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "v: 1\n"
    return Case(f"block mapping {depth} deep", {"recipe.yaml": TINY.read_bytes() + block.encode()}, ())


BAD_OVERRIDES = ["train.lr", "=3", "train..lr=1", ".seed=1", "seed.=1", "model.layers.99=attention",
                 "model.layers.-9=attention", "model.layers.x=1", "seed.x=1", "train.lr.x=1", "train.lr=[1,",
                 "tr\nain.lr=3", "train.l\u2028r=1", "model.layers.0.attention.n_heads.x=1", " =1", "train.=3",
                 "model.layers.0.mamba2.d_state=4", "seed=1\n2", "train=3", "model=[]", "task=mqar"]


def gen_override(rng):
    return Case("malformed override", {"recipe.yaml": TINY.read_bytes()}, (rng.choice(BAD_OVERRIDES),))


BAD_GRIDS = ["grid: 3", "grid: []", "grid: {seed: []}", "grid: {seed: 3}", "grid: [{label: x}, {label: x}]",
             "grid: [3]", "grid: {'': [1]}", "grid: {train.lr: [-1.0]}", "grid: {trian.lr: [1.0]}",
             "grid: [{1: 2}]", "grid: [{label: [a], seed: 1}]", "grid: {'train..lr': [1.0]}",
             "grid: {model.layers: [[attention], [atention]]}", "grid: {seed: [1, -1]}", "grid: !!set {a: null}",
             "grid: [{seed: 1}, {seed: [1, 2]}]", "grid: {model.d_model: [32, 33]}"]


def gen_grid(rng):
    return Case("malformed grid", {"recipe.yaml": (TINY.read_text() + rng.choice(BAD_GRIDS) + "\n").encode()}, ())


GENERATORS = [gen_misspelt_key, gen_misspelt_key, gen_wrong_type, gen_wrong_type, gen_bad_value, gen_bad_value,
              gen_incompatible, gen_unknown_name, gen_extends, gen_yaml_syntax, gen_non_utf8, gen_alias,
              gen_python_tag, gen_deep, gen_override, gen_grid]


# --------------------------------------------------------------------------------------- running
class TimedOut(Exception):
    pass


def _alarm(signum, frame):
    raise TimedOut()


def write(case: Case, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in case.files.items():
        (folder / name).write_bytes(data)
    return folder / "recipe.yaml"


def problem_in_process(case: Case, folder: Path) -> str | None:
    """Run ``zoo check`` in this process; the problem with how it ended, or None."""
    path = write(case, folder)
    err, out = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(["check", str(path), *case.args])
    except TimedOut:
        return f"no answer within {CASE_SECONDS}s"
    except BaseException as exc:  # noqa: BLE001 - anything escaping main is the bug being looked for
        return f"raised {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return judge(code, err.getvalue())


def judge(code, stderr: str) -> str | None:
    lines = stderr.splitlines()
    if code != 2:
        return f"exit code {code} (accepted as valid?) stderr={stderr[:300]!r}"
    if len(lines) != 1 or not lines[0].startswith("zoo: error: ") or "Traceback" in stderr:
        return f"stderr is not one error line: {stderr[:500]!r}"
    return None


def test_fuzz_malformed_recipes_end_in_one_line(tmp_path, _fresh_seed):
    import random
    rng = random.Random(_fresh_seed)
    marker = tmp_path / "pwned"
    cases = []
    for _ in range(CASES):
        generator = rng.choice(GENERATORS)
        cases.append(generator(rng, marker) if generator is gen_python_tag else generator(rng))
    # every python tag and self-reference once, whatever the seed
    cases += [Case("python tag (fixed)", {"recipe.yaml": f"seed: {tag}\n".encode() + TINY.read_bytes()}, ())
              for tag in python_tags(marker)]
    cases += [Case("self-reference (fixed)", {"recipe.yaml": TINY.read_bytes() + f"a: {ref}\n".encode()}, ())
              for ref in SELF_REFERENCES]
    failures = []
    for i, case in enumerate(cases):
        problem = problem_in_process(case, tmp_path / f"case{i}")
        if problem:
            failures.append(f"case {i} {case.show()}\n    -> {problem}")
    print(f"fuzz seed {_fresh_seed}: {len(cases)} cases, {len(failures)} failed")
    assert not marker.exists(), f"seed {_fresh_seed}: a recipe ran code"
    assert not failures, f"seed {_fresh_seed}: {len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:15])


def test_fuzz_cases_as_real_processes(tmp_path, _fresh_seed):
    """A handful of cases through `python -m zoo check`, all at once: same exit code and one line."""
    import random
    rng = random.Random(_fresh_seed)
    marker = tmp_path / "pwned"
    cases = [gen_python_tag(rng, marker), gen_alias(rng), gen_non_utf8(rng), gen_misspelt_key(rng),
             gen_override(rng), Case("deep", {"recipe.yaml": TINY.read_bytes()}, ("seed=" + "[" * 5000 + "]" * 5000,))]
    procs = []
    for i, case in enumerate(cases):
        path = write(case, tmp_path / f"case{i}")
        procs.append(subprocess.Popen([sys.executable, "-m", "zoo", "check", str(path), *case.args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    failures = []
    for case, proc in zip(cases, procs):
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            failures.append(f"{case.show()} -> hung")
            continue
        problem = judge(proc.returncode, err)
        if problem:
            failures.append(f"{case.show()} -> {problem}")
    assert not marker.exists(), f"seed {_fresh_seed}: a recipe ran code"
    assert not failures, f"seed {_fresh_seed}:\n" + "\n".join(failures)
