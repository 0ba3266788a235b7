"""Chapter 11: parallelism in several dimensions (page code)."""
