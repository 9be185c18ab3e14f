"""The ``python -m serve`` alias of :mod:`jaxdsa.serve` (the server itself lives there)."""
