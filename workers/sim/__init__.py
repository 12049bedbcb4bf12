"""Simulated engines: the real scheduler and KV bookkeeping with modelled step times."""
