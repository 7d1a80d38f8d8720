"""An lm-evaluation-harness adapter: a trained zoo language model scored as an ``lm_eval`` model.

:class:`ZooScorer` holds the three computations the harness asks of a model, on text:

- ``loglikelihood(context, continuation)``: the summed log-probability of the continuation's tokens after
  the context's (an empty context starts from EOS), and whether greedy decoding would produce them; the
  pair is split into tokens as the harness splits it (:meth:`ZooScorer.encode_pair`);
- ``loglikelihood_rolling(text)``: the summed log-probability of every token of ``text`` after EOS;
- ``generate_until(context, until, max_gen_toks)``: greedy decoding (``prefill`` then ``step``) until one
  of the ``until`` strings appears, which is cut off.

:func:`register` (``lm_eval`` imported only then; ``pip install -e ".[lm]"``) registers the
model under the name ``zoo``. From a shell, on a machine with network for the benchmark data::

    python -m zoo.lm_harness --model zoo --model_args checkpoint=runs/lm --tasks lambada_openai

which registers the model, then hands its arguments to the harness's own command line. A folder written
by ``zoo export`` runs through the harness's own ``hf`` model the same way (``--model hf --model_args
pretrained=DIR``), its log-likelihoods equal to this adapter's.

Test-time knobs take the checkpoint recipe's ``eval.test_time`` (the values its metrics were measured under), as
``zoo generate`` and ``zoo export`` do (:func:`zoo.generate.load_lm`); ``test_time.KNOB=VALUE`` in
``--model_args`` (``checkpoint=runs/fw,test_time.num_iter=10``), or ``ZooScorer.from_checkpoint(...,
test_time={knob: value})``, sets one over it, checked as the recipe's are (a knob no layer declares, or a value
the option refuses, is refused naming the knob and the layers that declare knobs). A :class:`ZooScorer` made
from a model scores it as it is.
"""
from __future__ import annotations

import codecs
import contextlib
import functools
import sys

import torch
import torch.nn.functional as F

from .errors import UserError
from .generate import generate_ids, load_lm

#: how a refusal of the checkpoint names the harness model that asked for it
HARNESS_MODEL = "lm_eval --model zoo"
#: how a ``test_time.KNOB=VALUE`` of ``--model_args`` is named in a refusal
MODEL_ARGS = "lm_eval --model zoo: --model_args test_time.{}"


class ZooScorer:
    """Log-likelihoods and greedy continuations of a trained language model (``model``, ``task``)."""

    def __init__(self, model, task):
        self.model, self.task, self.tok = model.eval(), task, task.tokenizer
        self.device = next(model.parameters()).device

    @classmethod
    def from_checkpoint(cls, checkpoint: str, device: str = "cpu", test_time=(),
                        where: str = "ZooScorer test_time {}") -> "ZooScorer":
        """The scorer of a checkpoint's model under its recipe's ``eval.test_time``, with ``test_time``
        (``{knob: value}`` or ``KNOB=VALUE`` texts) over it; ``where`` names an override in a refusal."""
        return cls(*load_lm(checkpoint, device, test_time=test_time, where=where, command=HARNESS_MODEL))

    @torch.no_grad()
    def _scores(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        ids = torch.tensor([context + continuation], device=self.device)
        logp = F.log_softmax(self.model(ids[:, :-1])[0].double(), -1)[-len(continuation):]
        target = ids[0, -len(continuation):]
        return logp.gather(1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The context's and the continuation's tokens, split as the harness splits them: whitespace that ends the
        context opens the continuation, and the continuation's tokens are the whole text's after the context's
        (a merge across the boundary scores as the model reads the text); where the whole text's tokens do not
        start with the context's (a boundary inside a merged token), the continuation is encoded alone."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self.tok.encode(context)
        whole = self.tok.encode(context + continuation)
        cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else self.tok.encode(continuation)
        return ctx, cont

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        ctx, cont = self.encode_pair(context, continuation)
        if not cont:
            return 0.0, True
        return self._scores(ctx or [self.tok.eos_id], cont)

    def loglikelihood_rolling(self, text: str) -> float:
        ids = self.tok.encode(text)
        return self._scores([self.tok.eos_id], ids)[0] if ids else 0.0

    def generate_until(self, context: str, until=(), max_gen_toks: int = 256) -> str:
        """Greedy continuation of ``context``, cut before the first of the ``until`` strings; decoding stops at
        the token that completes one (the rest could not change the cut text)."""
        prompt = self.tok.encode(context) or [self.tok.eos_id]
        stops = [stop for stop in until if stop]

        def text_of(ids, final=True):
            # while decoding, a character whose bytes are not all there yet is left out (not a replacement
            # character that a stop string could match before the character is complete)
            data = self.tok.decode([i for i in ids if i != self.tok.eos_id])
            return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=final)

        new, _, _ = generate_ids(self.model, prompt, max_gen_toks, eos_id=self.tok.eos_id,
                                 stop=(lambda ids: any(s in text_of(ids, final=False) for s in stops)) if stops else None)
        text = text_of(new)
        cuts = [text.find(stop) for stop in stops if stop in text]
        return text[:min(cuts)] if cuts else text


def harness_device(device: str | None) -> str:
    """The device to score on: the one the harness names, or, where it names a CUDA device and none is available,
    the CPU (the harness passes ``cuda:0`` unless ``--device`` says otherwise, and its ``hf`` model falls back
    to the CPU the same way)."""
    if device and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device or "cpu"


def model_args_test_time(model_args: dict) -> dict:
    """``{knob: value}`` of the ``test_time.KNOB=VALUE`` entries of ``--model_args`` (values as the harness reads
    them); the other entries (the harness's own: ``batch_size``, ...) are not the adapter's. A bare ``test_time``
    is refused with the form to write."""
    if "test_time" in model_args:
        raise UserError(f"lm_eval --model zoo: --model_args test_time={model_args['test_time']}: write each knob as "
                        f"test_time.KNOB=VALUE (e.g. checkpoint=runs/lm,test_time.num_iter=10)")
    return {k[len("test_time."):]: v for k, v in model_args.items() if k.startswith("test_time.")}


@functools.cache
def register():
    """Register :class:`ZooScorer` with ``lm_eval`` as the model ``zoo``; returns the registered class (once per
    process: the registry refuses a name given twice). The harness's own models (``hf`` among them) are
    registered first: its registry loads them only while it is empty, so a registry holding ``zoo`` alone would
    answer ``--model hf`` with "no model for this name"."""
    try:
        import lm_eval.models  # noqa: F401  (the harness's own models, registered by name)
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError as err:
        raise UserError(f"the lm-evaluation-harness adapter needs {err.name or 'lm_eval'}, which is not installed: "
                        f'pip install -e ".[lm]"') from None

    @register_model("zoo")
    class ZooHarnessLM(LM):
        def __init__(self, checkpoint: str, device: str | None = "cpu", **others):
            super().__init__()
            self.scorer = ZooScorer.from_checkpoint(checkpoint, harness_device(device), model_args_test_time(others),
                                                    MODEL_ARGS)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return [self.scorer.loglikelihood(*r.args) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return [self.scorer.loglikelihood_rolling(r.args[0]) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for r in requests:
                context, options = r.args
                until = options.get("until") or []
                out.append(self.scorer.generate_until(context, [until] if isinstance(until, str) else until,
                                                      int(options.get("max_gen_toks", 256))))
            return out

    return ZooHarnessLM


def main(argv: list[str] | None = None) -> None:
    """``python -m zoo.lm_harness ...``: register the model, then run the harness's command line. With the hf
    extra installed, a ``zoo export`` folder also loads as the harness's own ``hf`` model (``--model hf
    --model_args pretrained=DIR``)."""
    sys.argv = [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv)
    try:
        register()
        with contextlib.suppress(UserError):
            import zoo.hf  # noqa: F401  (registers the exported model type with transformers' Auto classes)
        from lm_eval.__main__ import cli_evaluate
        cli_evaluate()
    except UserError as err:   # a checkpoint or model argument the user can fix: one line, not a traceback
        raise SystemExit(f"python -m zoo.lm_harness: error: {err}") from None


if __name__ == "__main__":
    main()
