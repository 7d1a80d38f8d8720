"""Pure tensor functions for every mixer family: no nn.Module, no config.

Each family lives in ``kernels/<family>/`` with ``reference.py`` (the readable spec, a token-by-token
recurrence or explicit formula), ``chunked.py`` (the fast pure-PyTorch path, the CPU default) and
``triton.py`` (Triton kernels for the same function). The family's ``__init__.py`` exposes one public
function per op taking ``backend="auto"|"reference"|"torch"|"triton"``; :mod:`kernels.backend`
resolves the choice.

Tensor layout everywhere: ``(batch, time, heads, dim)``, as in flash-linear-attention.
"""
