"""``python -m cumf_dask`` is the ``cumf-dask`` command."""

import sys

from .cli import main

sys.exit(main())
