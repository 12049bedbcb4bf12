"""KV tiers below the engine's pool: host memory and a local disk folder."""
