"""shardwise.shard."""
