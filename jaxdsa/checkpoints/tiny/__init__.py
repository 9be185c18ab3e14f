"""Random tiny models in the real checkpoint layouts, for tests, fixtures and the bundled demo model.

One module per job, imported in this order (each only from those above it; none from the rest of
``jaxdsa``):

- :mod:`~jaxdsa.checkpoints.tiny.presets`: the tiny ``config.json`` dicts (standard library only);
- :mod:`~jaxdsa.checkpoints.tiny.writers`: random values, JSON and safetensors files, shards;
- :mod:`~jaxdsa.checkpoints.tiny.dsa`, :mod:`~jaxdsa.checkpoints.tiny.v4`,
  :mod:`~jaxdsa.checkpoints.tiny.glm5_next`: the per-family makers (tensor names and shapes from
  docs/models.md §4 and §9.8);
- :mod:`~jaxdsa.checkpoints.tiny.make`: :func:`~jaxdsa.checkpoints.tiny.make.make_tiny`, any family;
- :mod:`~jaxdsa.checkpoints.tiny.cli`: the command line, ``python -m jaxdsa.checkpoints.make_tiny``.

This file imports nothing, so reading the presets does not load the writers.
"""
