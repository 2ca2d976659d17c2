"""``python -m bench.results``: writes docs/results.md from bench/results/history.jsonl."""

import sys

from bench.results import main

sys.exit(main())
