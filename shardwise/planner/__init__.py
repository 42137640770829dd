"""shardwise.planner: predict, for a model on a cluster, the step time and memory of every
parallel layout, and search for the best one. See docs/planner.md."""

from shardwise.planner.catalogue import (get_model_spec, list_models, load_model_config,
                                         planner_only_models)
from shardwise.planner.hardware import Hardware, get_hardware, list_hardware
from shardwise.planner.spec import ModelSpec

__all__ = ["ModelSpec", "get_model_spec", "list_models", "load_model_config",
           "planner_only_models", "Hardware", "get_hardware", "list_hardware"]
