"""`python -m fp8stack ...` runs the command line, like the `fp8stack` script."""

import sys

from fp8stack.cli import main

sys.exit(main())
