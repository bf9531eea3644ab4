import sys

from tools.forks.cli import main

sys.exit(main())
