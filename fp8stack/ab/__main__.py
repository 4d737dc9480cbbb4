"""`python -m fp8stack.ab ...`: the same as `fp8stack ab ...`."""

import sys

from fp8stack.ab.run import main

sys.exit(main())
