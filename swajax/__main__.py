"""`python -m swajax generate ...` / `python -m swajax info ...`: see `swajax.cli`."""

import sys

from swajax.cli import main

sys.exit(main())
