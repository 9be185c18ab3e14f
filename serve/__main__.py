"""``python -m serve``: the same command line as ``python -m jaxdsa.serve`` (:mod:`jaxdsa.serve.cli`)."""

from jaxdsa.serve.cli import main

main()
