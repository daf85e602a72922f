"""The bench's tables, one module each."""
