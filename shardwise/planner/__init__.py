"""shardwise.planner."""
