"""shardwise.models."""
