"""The tier-2 simulator: simulated engines, the real routing core and the real Redis index,
replaying traces without Ray."""
