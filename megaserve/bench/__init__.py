"""Benchmarks run by `megaserve bench ...`."""
