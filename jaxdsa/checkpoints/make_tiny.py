"""``python -m jaxdsa.checkpoints.make_tiny``: a random tiny model in the real Hugging Face layout.

The command line is :mod:`jaxdsa.checkpoints.tiny.cli`; the library entry is
:func:`jaxdsa.checkpoints.tiny.make.make_tiny`.
"""

from jaxdsa.checkpoints.tiny.cli import main

if __name__ == "__main__":
    main()
