"""Pure tensor functions for every mixer family: no nn.Module, no config.

Each family lives in ``kernels/<family>/`` with ``reference.py`` (the readable spec and reference oracle,
``backend="reference"``: a token-by-token recurrence or explicit formula), ``chunked.py`` (``backend="torch"``,
the fast pure-PyTorch path: what ``auto`` runs on a CPU, and on CUDA where no faster backend takes the inputs)
and ``triton.py`` (``backend="triton"``, Triton kernels for the same function: what ``auto`` runs on CUDA) and,
where another project has CUDA kernels for it, ``outside.py`` (imported lazily). Math that several of these
paths share has a module named for what it is (``gka/chebyshev.py``, ``ska/operator.py``,
``slots/addressing.py``). The family's ``__init__.py`` exposes one public function per op
taking ``backend="auto"|"reference"|"torch"|"triton"`` (or an outside backend: ``flash_attn``,
``fla``, ``mamba_ssm``) and passes the backends it implements to
:func:`kernels.backend.resolve_backend`, which alone decides what can run. The one-token step of every
family lives in ``reference.py`` beside the reference loop built from it; shared idioms (compute
dtype, causal decay masks, time padding, the state pass across chunks) are in :mod:`kernels.common`.

Tensor layout everywhere: ``(batch, time, heads, dim)``, as in flash-linear-attention.
"""
