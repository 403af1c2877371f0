"""A tensor mode's torch-free half: how it cuts a tensor block, with no process and no layer.

Each mode package has a ``geometry.py`` leaf holding one ``ModeGeometry`` (2d and 2.5d: one
each); ``modes.py`` registers them by config name. What reads a mode without building its
layers reads this half: the config (allowed names, size checks), ``topology.py`` (the
groups of one tensor block and the extra groups over data x tensor), ``tags.py`` (which
group averages a replicated weight's gradient), the engine and ``hf/`` (whether positions
are split), ``gridtrain estimate`` (head split, activation blocks, the collectives of each
planned layer). The runtime half (layers, loss, forward context) is the ``TensorMode`` that
``runtime`` names, found by ``tensor/registry.py``.

The base class is no tensor mode: every rank holds every layer whole and the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gridtrain.parallel.mode import ParallelMode

BlockGroups = dict[ParallelMode, list[list[int]]]  # mode -> groups of tensor ranks 0..size-1
Groups = dict[ParallelMode, list[tuple[int, ...]]]  # mode -> groups of global ranks
Rank = Callable[[int, int, int], int]  # (data, pipeline, tensor) index -> global rank
Sizes = tuple[int, int, int, int]  # the grid's axes: data, pipeline, tensor, expert-parallel


@dataclass(frozen=True)
class ModeGeometry:
    """One tensor mode's geometry (module docstring); a mode subclasses what differs.

    ``runtime``: ``"module:attribute"`` of the mode's ``TensorMode``. ``data_parallel``: the
    group over which a replicated weight's gradient is averaged. ``splits_sequence``: the
    tensor group holds consecutive positions of one batch (weights whole; attention looks
    across ranks, token losses are summed over the group). ``uses_depth``: the mode reads
    ``parallel.tensor.depth``. ``blocked``: activations are cut over rows and the hidden dim
    (every Linear is the mode's own). ``vocab_parallel_loss``: the cross entropy runs on logits
    cut over the vocabulary (else torch's dense cross entropy on whole logits).
    """

    name: str | None = None
    runtime: str = "gridtrain.parallel.tensor.none.runtime:MODE"
    data_parallel: ParallelMode = ParallelMode.DATA
    splits_sequence: bool = False
    uses_depth: bool = False
    blocked: bool = False
    vocab_parallel_loss: bool = False

    def check(self, size: int, depth: int) -> None:
        """Raise ValueError (with the numbers) if ``size`` ranks in ``depth`` layers cannot
        form this mode's block; the config calls it before any process exists."""

    def side(self, size: int, depth: int) -> int:
        """The block's side: 2d/2.5d q, 3d d; the group size otherwise."""
        return size

    def groups(self, size: int, depth: int) -> BlockGroups:
        """One tensor block's groups of each of the mode's own ParallelModes."""
        return {}

    def extra_groups(self, rank: Rank, sizes: Sizes) -> Groups:
        """Groups across the data and tensor axes that the mode adds or redefines."""
        return {}

    def head_split(self, size: int, depth: int) -> tuple[int, str]:
        """(ways attention heads are split, the group that splits them, in words)."""
        return 1, "no group"

    def batch_split(self, size: int, depth: int) -> tuple[int, str]:
        """(blocks a micro-batch's rows are cut into on one tensor block, those blocks in
        words)."""
        return 1, "nothing"

    def sequence_split(self, size: int, depth: int) -> tuple[int, str]:
        """(ways the positions of a sequence are cut, the group that cuts them, in words)."""
        return 1, "no group"

    def data_parallel_span(self, size: int) -> int:
        """Ranks of one tensor block inside ``data_parallel`` (with the data ranks, the group
        a replicated weight's gradient is averaged and ZeRO-sharded over)."""
        return 1

    def fits(self, size: int, heads: int, seq_len: int) -> tuple[int, ...]:
        """The depths at which ``size`` ranks form the mode's block and split ``heads`` (key /
        value heads) or ``seq_len`` positions evenly (``gridtrain estimate --search``)."""
        return ()

    # ---- cost formulas for ``gridtrain estimate`` (``g``: an ``estimate.geometry.Geometry``)
    def row_blocks(self, g: Any) -> int:
        """Batch blocks of one tensor group (``split_batch``)."""
        return 1

    def seq_parts(self, g: Any) -> int:
        """Ways the sequence is cut."""
        return self.sequence_split(g.size, g.depth)[0]

    def hidden_parts(self, g: Any) -> int:
        """Ways the residual stream's hidden dim is cut."""
        return 1

    def gather(self, g: Any) -> int:
        """How many times more rows a Linear saves than the rank's block (3d's input gather)."""
        return 1

    def lookup_rows(self, g: Any) -> int:
        """How many times the rank's rows of token ids an embedding keeps (ids and masks)."""
        return self.gather(g)

    def saved_weights(self, g: Any) -> int:
        """Copies of its local weight a Linear saves for backward (3d: the gathered weight);
        0: the layer saves none of its own (autocast may keep a cast copy)."""
        return 0

    def linear_input_dtype(self, after_norm: bool) -> str:
        """What a Linear saves its input as (``estimate.memory.dtype_bytes``' key): the compute
        dtype ``"e"``, or the residual stream's ``"r"`` where the layer keeps a norm's output
        as it comes."""
        return "e"

    def attention_items(self, g: Any, sc: Any, spec: Any, t: float, heads: float, nb: dict):
        """The (what, bytes) a block's attention saves where the mode runs its own attention
        (sequence: the ring), else None (SDPA or the unfused math, as ``estimate`` counts)."""
        return None

    def in_width(self, g: Any, width: int, role: str) -> float:
        """Input features of a Linear of role "column" or "row" on one rank."""
        return width / self.hidden_parts(g)

    def out_width(self, g: Any, width: int, role: str) -> float:
        """Output features of a Linear of role "column" or "row" on one rank."""
        return width / self.hidden_parts(g)

    def layer_collectives(self, c: Any, name: str, entry: Any) -> None:
        """Add to ``c`` (``estimate.collectives``' builder) what planned layer ``entry`` sends."""

    def attention_collectives(self, c: Any) -> None:
        """Add to ``c`` what a block's attention sends beyond its planned layers."""

    def loss_collectives(self, c: Any) -> None:
        """Add to ``c`` what the mode's cross-entropy loss sends."""
