"""``python -m serve``: see :mod:`serve.cli`."""

from serve.cli import main

main()
