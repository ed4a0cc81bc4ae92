"""`python -m qgrpo ...`: the `qgrpo` command."""
import sys

from qgrpo.cluster.cli.app import main

sys.exit(main())
