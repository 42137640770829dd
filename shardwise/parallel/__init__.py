"""shardwise.parallel."""
