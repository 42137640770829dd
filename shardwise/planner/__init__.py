"""shardwise.planner: predict, for a model on a cluster, the step time, memory and bottleneck
of every parallel layout, and search for the best one. See docs/planner.md.

    from shardwise.planner import Workload, get_hardware, get_model_spec, search
    res = search(get_model_spec("llama3-405b"), get_hardware("h100"),
                 Workload(seq_len=8192, global_batch=2048), gpus=16384)
    best = res.ranked[0]; best.layout, best.step_time, best.memory.total, best.bottleneck
"""

from shardwise.planner.calibrate import StepMeasurement, calibrate
from shardwise.planner.catalogue import (get_model_spec, list_models, load_model_config,
                                         planner_only_models)
from shardwise.planner.cost_model import CostModel, Estimate
from shardwise.planner.hardware import Hardware, get_hardware, list_hardware
from shardwise.planner.parallel_layout import Layout, check_layout, parse_layout
from shardwise.planner.search import SearchResult, evaluate, search
from shardwise.planner.spec import ModelSpec
from shardwise.planner.workload import Workload

__all__ = ["ModelSpec", "get_model_spec", "list_models", "load_model_config",
           "planner_only_models", "Hardware", "get_hardware", "list_hardware", "Workload",
           "Layout", "parse_layout", "check_layout", "CostModel", "Estimate", "search",
           "evaluate", "SearchResult", "StepMeasurement", "calibrate"]
