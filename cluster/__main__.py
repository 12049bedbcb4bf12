"""`python -m cluster` is the `prefixserve` command."""

import sys

from cluster.cli import main

sys.exit(main())
