"""Pallas (Triton GPU backend) kernels for the DSA hot path, each with a pure-JAX oracle.

Every kernel lives in its own package: ``kernel.py`` (the ``pallas_call``), ``ref.py`` (the
reference with the same signature) and ``tuning.py`` (block sizes per GPU). Shared code lives
beside them: ``_triton.py`` (Pallas-Triton plumbing) and ``quant/`` (the quantized-weight format,
its in-kernel decoders and tile reads). Model code never imports these packages directly; it goes
through :mod:`jaxdsa.ops` (and :mod:`jaxdsa.quantized_weight` for the weight type).
"""
