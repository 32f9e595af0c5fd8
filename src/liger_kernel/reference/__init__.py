"""Pure-torch reference implementations that the tests and benchmarks compare the kernels with."""
