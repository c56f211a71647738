"""Performance accounting: compiled communication, memory (compiled and analytic), benchmarks."""
