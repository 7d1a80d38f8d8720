"""``python -m zoo`` is the ``zoo`` command."""
import sys

from .errors import interrupted_while_starting

try:
    from .cli import main
except KeyboardInterrupt:  # a Ctrl-C before the command line module has started
    raise interrupted_while_starting() from None

sys.exit(main())
