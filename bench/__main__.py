"""`python -m bench` is the `prefixserve-bench` command."""

import sys

from bench.cli import main

sys.exit(main())
