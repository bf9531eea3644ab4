"""`python -m tools.data`."""

import sys

from tools.data.cli import main

sys.exit(main())
