"""`python -m prefixserve.cluster` is the `prefixserve` command."""

import sys

from prefixserve.cluster.cli import main

sys.exit(main())
