"""`freetoken bench`: benchmarks as commands, each printing ratios measured in one run."""
