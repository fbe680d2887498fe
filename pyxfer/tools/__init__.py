"""pyxfer's command-line tools and what only they use: the CLI (cli), `pyxfer doctor` (doctor, with its
self-checks in selftest and its verdict cache in verdict_cache), `pyxfer bench` (bench), the timing
method (timing, shared with benchmarks/) and the machine facts of reports (machine). Nothing here is
imported by ``import pyxfer``."""
