"""shardwise.data."""
