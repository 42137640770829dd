"""shardwise.planner: predict, for a model on a cluster, the step time, memory and bottleneck
of every parallel layout, and search for the best one. See docs/planner.md.

    from shardwise.planner import Workload, get_hardware, get_model_spec, search
    res = search(get_model_spec("llama3-405b"), get_hardware("h100"),
                 Workload(seq_len=8192, global_batch=2048), gpus=16384)
    best = res.ranked[0]; best.layout, best.step_time, best.memory.total, best.bottleneck

How it is built. A :class:`Layout` (parallel_layout.py) of a :class:`ModelSpec` (spec.py)
for a :class:`Workload` is priced by a :class:`CostModel` (cost_model.py) that holds no
device branch: what the device does is asked of its **device model** (devices/), chosen
for the hardware entry by ``devices.registry.device_model`` (a GPU's roofline, or a
calibrated CPU rank). The protocol (devices/base.py) has three parts:

* per-layer compute seconds: ``layer_seconds`` of a layer's work (work.py: multiplies,
  kernels' bytes), ``attention_seconds`` of its attention core alone (what a
  context-parallel ring step hides behind), ``composition`` factors, ``edge_seconds`` of
  the embedding and loss, ``accumulate_seconds`` of gradient accumulation,
  ``optimizer_seconds``;
* per-collective seconds: ``all_gather``, ``reduce_scatter``, ``all_reduce``,
  ``all_to_all``, ``dispatch``, ``p2p`` on a placed group (comm_model.Group), and the
  exposed seconds of what tensor parallelism sends (``tp_seconds``, ``tp_edge_seconds``),
  read from the one list of what each parallelism sends (sends.py; context parallelism's
  ring steps and all-to-alls are exposed by stage_cost.py from the same list);
* how a step's parts combine: ``overlaps`` (may collectives hide behind compute),
  ``transient_bytes`` (gathered parameters and buffers at the peak), ``combine`` (the
  step's components once the device's own effects are in: a GPU's engine copies, CPU
  cores' contention and time-sharing), ``crowded`` / ``in_world`` (one rank's timeline
  priced apart).

stage_cost.py adds up a pipeline rank's micro-batch, dp_cost.py its data-parallel
collectives, pipeline.py the schedule's bubble from the pipeline registry
(``shardwise.parallel.pipeline.schedules``) and the engine actions of its schedules;
search.py searches the space. calibrate/ measures the local machine and refits a device
to measured steps; validate/ predicts published runs (``python -m
shardwise.planner.validation``).
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
