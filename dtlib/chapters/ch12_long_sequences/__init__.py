"""Chapter 12, long sequences: what the page runs (``runs``) and draws (``figures``)."""
