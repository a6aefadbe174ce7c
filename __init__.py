"""hpcai: an MPI-native distributed training launcher for HPC sites."""

import os as _os

# scripts/install.sh puts this checkout on the path through a link (.venv/hpcai-src/hpcai):
# the modules' paths are the checkout's own. (pytest may import this file as a plain module,
# without a __path__, when the checkout's folder name is not an identifier.)
__file__ = _os.path.realpath(__file__)
if "__path__" in globals():
    __path__[:] = [_os.path.realpath(p) for p in __path__]

__version__ = "0.1.0"
