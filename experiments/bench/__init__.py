"""Benchmarks and machine checks: decode and kernel throughput, precision, SortedRL's scheduler,
against Hugging Face and TRL, float bits of dots across CPUs, the dry run over every config and
the default experiment's fingerprint. Each records figures with provenance under
experiments/results/; none asserts a time."""
