import sys

from llamapool.worker.server import main

sys.exit(main())
