"""clbench: a declarative continual-learning benchmark for LLM post-training."""

import os
import sys

__version__ = "0.1.0"

# `python -m clbench.cli` (how `accelerate launch` and a sweep start runs) puts the working
# folder first on the import path, so a `rich.py` or `yaml.py` lying in a results or suite folder
# would be imported in place of the library, and run. Code runs only from what the user
# installed or named: the working folder is taken off the path while `-m` is locating us.
if sys.argv[:1] == ["-m"] and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]
