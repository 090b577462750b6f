"""Worker process entry point. llama_cpp is imported first, before numpy and pyzmq: with the CUDA
build on H200 machines, loading a model segfaulted when either had been imported earlier."""

import llama_cpp  # noqa: F401, I001 - must come first, see above
import sys

from llamapool.lifeline import die_with_parent
from llamapool.worker.server import main

die_with_parent()

sys.exit(main())
