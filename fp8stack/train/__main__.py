"""`python -m fp8stack.train ...`: the same as `fp8stack train ...` (fp8stack.train.command)."""

import sys

from fp8stack.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
