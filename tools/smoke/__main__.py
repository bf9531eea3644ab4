"""`python -m tools.smoke`."""

import sys

from tools.smoke.cli import main

sys.exit(main())
