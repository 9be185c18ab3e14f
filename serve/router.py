"""``python -m serve.router``: the prefill-decode router of :mod:`jaxdsa.serve.router`."""

from jaxdsa.serve.router import main

if __name__ == "__main__":
    main()
