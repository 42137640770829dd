"""shardwise.checkpoint."""
