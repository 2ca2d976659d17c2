"""``python -m cacheflow_jax.cli``: the ``cacheflow`` command."""

import sys

from cacheflow_jax.cli import main

sys.exit(main())
