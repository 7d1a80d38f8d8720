"""``python -m zoo`` is the ``zoo`` command."""
import sys

from .cli import main

sys.exit(main())
