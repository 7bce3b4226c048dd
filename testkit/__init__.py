"""Helpers that tests and benchmarks use and the product never imports."""
