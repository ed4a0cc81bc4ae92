import sys

from qgrpo.cluster.cli.app import main

sys.exit(main())
