"""python3 -m zeroplan: zero-plan's command line (the same flags, output and exit codes)."""
import sys

from . import main

sys.exit(main())
