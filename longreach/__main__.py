"""``python -m longreach``: the ``longreach`` command, where its script is not on ``PATH`` (``pip install --target``,
``--user``, a virtual environment that is not activated)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
