"""Tests with real training frameworks (Lightning, torchtitan, Accelerate) on CPU."""
