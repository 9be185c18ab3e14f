"""``python -m jaxdsa.serve`` (also ``python -m serve``): see :mod:`jaxdsa.serve.cli`."""

from jaxdsa.serve.cli import main

main()
