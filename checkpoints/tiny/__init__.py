"""Random tiny models in the real checkpoint layouts, for tests, fixtures and the bundled demo model.

One module per job, imported in this order (each only from those above it; none from ``jaxdsa``):

- :mod:`~checkpoints.tiny.presets`: the tiny ``config.json`` dicts (standard library only);
- :mod:`~checkpoints.tiny.writers`: random values, JSON and safetensors files, shards;
- :mod:`~checkpoints.tiny.dsa`, :mod:`~checkpoints.tiny.v4`: the per-family makers (tensor names and
  shapes from docs/models.md §4);
- :mod:`~checkpoints.tiny.make`: :func:`~checkpoints.tiny.make.make_tiny`, any family;
- :mod:`~checkpoints.tiny.cli`: the command line, ``python -m checkpoints.make_tiny``.

This file imports nothing, so reading the presets does not load the writers.
"""
