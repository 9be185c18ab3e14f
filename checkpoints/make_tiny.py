"""``python -m checkpoints.make_tiny``: a random tiny model in the real Hugging Face layout.

The command line is :mod:`checkpoints.tiny.cli`; the library entry is
:func:`checkpoints.tiny.make.make_tiny`.
"""

from checkpoints.tiny.cli import main

if __name__ == "__main__":
    main()
