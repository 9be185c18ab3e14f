"""Pallas (Triton GPU backend) kernels for the DSA hot path, each with a pure-JAX oracle.

Every kernel lives in its own package: ``kernel.py`` (the ``pallas_call``), ``ref.py`` (the
reference with the same signature) and ``tuning.py`` (block sizes per GPU). Model code never
imports these packages directly; it goes through :mod:`jaxdsa.ops`.
"""
