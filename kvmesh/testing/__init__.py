"""Test and benchmark harnesses shared by tests/ and bench/ (no model needed)."""
