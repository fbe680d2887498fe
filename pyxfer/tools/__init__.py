"""pyxfer's command-line tools and what only they use: the CLI (cli), `pyxfer doctor` (doctor, with its
self-checks in selftest and its verdict cache in verdict_cache), `pyxfer bench` (bench, the command; its
measurement in bench_measure, its report and PNG in bench_report, its JSON document in bench_schema), the
timing method (timing, shared with benchmarks/), the machine facts of reports (machine) and the atomic
JSON write of both commands (files). Nothing here is imported by ``import pyxfer``."""
