"""Zoo language models as Hugging Face ``transformers`` models (the optional extra ``hf``).

Importing this package registers :class:`ZooConfig` and :class:`ZooForCausalLM` with ``AutoConfig`` and
``AutoModelForCausalLM``, so a folder written by ``zoo export RUN --to DIR`` loads with
``AutoModelForCausalLM.from_pretrained(DIR)`` and no ``trust_remote_code``::

    import zoo.hf  # noqa: F401  (registers the model type mixer_zoo)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(DIR), AutoTokenizer.from_pretrained(DIR)
    out = model.generate(**tok("The for statement", return_tensors="pt"), max_new_tokens=50)

The model computes with the test-time knob values stored in its config (``config.test_time``: the recipe's
``eval.test_time`` unless ``zoo export --test-time`` changed one), so its logits are the zoo model's as the run's
metrics were measured, and ``zoo generate``'s and the harness adapter's.

Modules: :mod:`.config` (the recipe as a config), :mod:`.cache` (every layer's decode state as a
``Cache``), :mod:`.model` (the causal LM), :mod:`.tokenizer` (the run's tokenizer as a transformers
tokenizer) and :mod:`.export` (``zoo export``). Without ``transformers`` installed, importing it raises
one :class:`zoo.errors.UserError` naming the extra.
"""
from __future__ import annotations

from ..errors import UserError

try:
    import safetensors  # noqa: F401  (save_pretrained writes model.safetensors)
    import transformers
except ImportError as err:
    raise UserError(f"the Hugging Face export needs {err.name or 'transformers'}, which is not installed: "
                    f"pip install 'mixer-zoo[hf]'") from None

from .cache import ZooCache  # noqa: E402
from .config import MODEL_TYPE, ZooConfig  # noqa: E402
from .model import ZooForCausalLM  # noqa: E402

transformers.AutoConfig.register(MODEL_TYPE, ZooConfig, exist_ok=True)
transformers.AutoModelForCausalLM.register(ZooConfig, ZooForCausalLM, exist_ok=True)

__all__ = ["ZooCache", "ZooConfig", "ZooForCausalLM"]
