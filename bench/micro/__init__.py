"""Microbenchmarks of one part at a time: the engine, the index in Redis at fleet scale, one
routing decision, Redis round trips."""
