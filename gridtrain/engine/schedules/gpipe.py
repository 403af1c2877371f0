"""GPipe (Huang et al. 2019): every micro-batch's forward, then every micro-batch's backward.

The same bubble as 1F1B, but each stage keeps all ``num_microbatches`` micro-batches'
activations until the backwards start (1F1B keeps at most ``pipeline_size - stage``). It is
the simplest pipeline order, useful to compare against and with models whose backward must
not interleave with forwards. It runs 1F1B's loop with every forward a warm-up one
(``config/pipeline.py``'s ``WARMUP``): no steady phase, then the backwards in order.
"""

from __future__ import annotations

from gridtrain.engine.schedules.one_f_one_b import PipelineSchedule


class GPipeSchedule(PipelineSchedule):
    """All forwards, then all backwards in the same (first-in, first-out) order."""

    name = "gpipe"  # parallel.pipeline.schedule; WARMUP: every micro-batch
