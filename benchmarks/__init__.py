"""commpress benchmark suites: ``python -m benchmarks --help``."""
