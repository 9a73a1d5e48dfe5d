"""``python -m ddtree_jax.bench``: the benchmark subcommands (ddtree_jax.bench)."""

import sys

from ddtree_jax.bench import main

sys.exit(main())
