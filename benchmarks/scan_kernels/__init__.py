"""Kernel microbenchmarks: tree scans and tree recurrences at real layer shapes, one layer at a time."""
