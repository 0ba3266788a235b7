"""Chapter 14: mixture of experts and expert parallelism (page code)."""
