"""`python -m nextstate.cli`: the `nextstate` command (how `nextstate up` starts its worker and trainer)."""

import sys

from nextstate.cli import main

sys.exit(main())
