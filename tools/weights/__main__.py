import sys

from tools.weights.cli import main

sys.exit(main())
