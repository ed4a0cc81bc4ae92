import sys

from cluster.cli.app import main

sys.exit(main())
