"""`python -m prefixserve.bench` is the `prefixserve-bench` command."""

import sys

from prefixserve.bench.cli import main

sys.exit(main())
