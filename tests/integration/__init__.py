"""Tests that run kvoffload inside engines (each in its own environment; see .ci/run)."""
