"""shardwise.train."""
