"""Chapter 15: low-communication training (page code)."""
