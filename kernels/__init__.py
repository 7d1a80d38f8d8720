"""Pure tensor functions for every mixer family: no nn.Module, no config.

Each family lives in ``kernels/<family>/`` with ``reference.py`` (the readable spec, a token-by-token
recurrence or explicit formula), ``chunked.py`` (the fast pure-PyTorch path, the CPU default) and
``triton.py`` (Triton kernels for the same function) and, where another project has CUDA kernels for
it, ``outside.py`` (imported lazily). The family's ``__init__.py`` exposes one public function per op
taking ``backend="auto"|"reference"|"torch"|"triton"`` (or an outside backend: ``flash_attn``,
``fla``, ``mamba_ssm``) and passes the backends it implements to
:func:`kernels.backend.resolve_backend`, which alone decides what can run. The one-token step of every
family lives in ``reference.py`` beside the reference loop built from it; shared idioms (compute
dtype, causal decay masks, time padding, the state pass across chunks) are in :mod:`kernels.common`.

Tensor layout everywhere: ``(batch, time, heads, dim)``, as in flash-linear-attention.
"""
