import sys

from tools.install.cli import main

sys.exit(main())
