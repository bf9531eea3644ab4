import sys

from tools.launch.cli import main

sys.exit(main())
