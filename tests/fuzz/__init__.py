"""qtool's mutation fuzzer: `python -m tests.fuzz --help`, and tests/fuzz/README.md."""
