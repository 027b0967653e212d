"""Where a candidate puts things: its resolved layout, the groups each axis communicates in (size and the nodes
they span, from Megatron's rank grids and ``gpus_per_node``) and the blocks each pipeline rank holds. Torch-free.

The groups come from :class:`meshplan.plan_file.layout.ResolvedLayout` (the rank engine ``meshplan ranks`` and
the DeviceMesh use), so "tp inside a node" is what the order string and ``--gpus-per-node`` make it. Every group
of an axis is a translate of the one holding rank 0, which is the one measured here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.plan_file.layout import Layout, ResolvedLayout
from meshplan.plan_file.pipeline import V_SCHEDULES
from meshplan.plan_file.stages import balanced, local_stage_ids
from meshplan.solver.candidate import Candidate

__all__ = ["Group", "Placement", "resolve"]


@dataclass(frozen=True)
class Group:
    """One communication group: ``size`` ranks on ``nodes`` nodes; ``name``: its key in :attr:`Placement.groups`
    (which ranks a given rank's group holds: :meth:`Placement.group_ranks`; not compared)."""

    size: int
    nodes: int
    name: str = field(default="", compare=False)


def resolve(cand: Candidate) -> ResolvedLayout:
    """The candidate's layout resolved with :meth:`Layout.resolve` (Megatron's rules, the plan's wording). The
    degrees are not re-validated field by field (the search builds them in bounds; a plan's were validated when
    it was read).

    Raises:
        PlanError: the layout breaks one of the rules (the message of ``meshplan check``).
    """
    lay = Layout.model_construct(tp=cand.tp, cp=cand.cp, ep=cand.ep, etp=cand.etp, pp=cand.pp, vpp=cand.vpp,
                                 dp_replicate=cand.dp_replicate, dp_shard=cand.dp_shard, order=cand.order)
    return lay.resolve(cand.world)


class Placement:
    """A candidate's groups and pipeline blocks.

    Args:
        cand: the candidate. layers: the model's blocks. gpus_per_node: ranks per node.

    Raises:
        PlanError: the layout does not resolve (see :func:`resolve`).
    """

    def __init__(self, cand: Candidate, layers: int, gpus_per_node: int, base: "Placement | None" = None):
        self.cand, self.layers = cand, layers
        self.gpus_per_node = gpus_per_node
        self.memo: dict = {}  # what evaluations of this placement's candidates share (meshplan.solver.step)
        if base is not None:  # the same degrees and order: the same groups, other stages
            self.layout, self.groups = base.layout, base.groups
        else:
            self.layout = resolve(cand)
            self.groups = self._groups(cand)
        n_stages = cand.pp * cand.vpp
        sizes = balanced(layers, n_stages) if layers >= n_stages else [0] * n_stages
        starts = [sum(sizes[:s]) for s in range(n_stages)]
        self.stage_blocks = [list(range(starts[s], starts[s] + sizes[s])) for s in range(n_stages)]
        self.v_shape = cand.schedule in V_SCHEDULES
        self._stages = [self._stage_ids(r) for r in range(cand.pp)]
        self._blocks = [[b for st in self._stages[r] for b in self.stage_blocks[st]] for r in range(cand.pp)]
        self._ranges = [[(starts[st], starts[st] + sizes[st]) for st in self._stages[r]] for r in range(cand.pp)]
        last = len(self.stage_blocks) - 1
        self._ends = [(0 in self._stages[r], last in self._stages[r]) for r in range(cand.pp)]

    def with_stages(self, cand: Candidate) -> "Placement":
        """The placement of ``cand``, which differs from this one's candidate in schedule, vpp, microbatching or
        checkpointing only."""
        return Placement(cand, self.layers, self.gpus_per_node, base=self)

    @staticmethod
    def shard_axes(cand: Candidate) -> tuple[str, ...]:
        """The axes FSDP2 shards a dense tensor over (HSDP: dp_replicate replicates)."""
        if cand.dp_replicate == 1 or cand.mode != "fsdp":
            return ("dp_shard", "cp")
        return ("dp_shard", "dp_replicate", "cp")

    def wrap_axes(self) -> list[str]:
        """The axes (above 1) of the group FSDP2 shards the dense tensors over, or DDP's replicas."""
        axes = ("dp_shard", "dp_replicate", "cp") if self.cand.mode == "ddp" else self.shard_axes(self.cand)
        return [a for a in axes if self.layout.sizes().get(a, 1) > 1]

    def shard_index(self, rank: int) -> tuple[int, int]:
        """``(dense, expert)``: global rank ``rank``'s index in the group FSDP2 shards its dense tensors over, and
        in its edp group (the expert tensors'): which of the ``ceil(rows / d)``-row chunks of dim 0 it holds.

        Example: dp_shard 128, rank 127 of the group holds rows ``127·126 …`` of a 16,032-row tensor: 30."""
        dense = self.layout.mesh_grid.group_of(rank, self.shard_axes(self.cand))
        expert = self.layout.expert_grid.group_of(rank, "edp")
        return dense.index(rank), expert.index(rank)

    def _groups(self, cand: Candidate) -> dict[str, Group]:
        shard_axes = self.shard_axes(cand)
        mesh, dense, expert = self.layout.mesh_grid, self.layout.dense_grid, self.layout.expert_grid
        groups = {
            "tp": dense.group_of(0, "tp"), "cp": dense.group_of(0, "cp"),
            "pp": dense.group_of(0, "pp")[:2],  # a pipeline hop: rank 0 and its next stage
            "dp_shard": mesh.group_of(0, shard_axes), "dp_replicate": mesh.group_of(0, "dp_replicate"),
            "dp": mesh.group_of(0, ("dp_shard", "dp_replicate", "cp")),
            "ep": expert.group_of(0, "ep"), "etp": expert.group_of(0, "etp"), "edp": expert.group_of(0, "edp"),
            "embd": self._ends_group(dense.group_of(0, "pp")),
        }
        out = {k: Group(*self._group(v), name=k) for k, v in groups.items()}
        return {**out, "world": Group(cand.world, max(1, -(-cand.world // self.gpus_per_node)), "world")}

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """The ranks of global ``rank``'s group ``name`` (a key of :attr:`groups`, the one holding rank 0 measured
        there); ``pp``: its pipeline peers, the previous and the next stage's rank (around the ring when a rank
        holds interleaved stages)."""
        mesh, dense, expert = self.layout.mesh_grid, self.layout.dense_grid, self.layout.expert_grid
        if name == "world":
            return list(range(self.cand.world))
        if name in ("pp", "embd"):
            line = dense.group_of(rank, "pp")
            if name == "embd":
                return self._ends_group(line)
            i, p, ring = line.index(rank), len(line), self.cand.vpp > 1 and not self.v_shape
            return sorted({line[j % p] for j in (i - 1, i + 1) if ring or 0 <= j < p} - {rank})
        axes = {"dp_shard": self.shard_axes(self.cand), "dp": ("dp_shard", "dp_replicate", "cp")}.get(name, name)
        grid = expert if name in ("ep", "etp", "edp") else dense if name in ("tp", "cp") else mesh
        return grid.group_of(rank, axes)

    @staticmethod
    def _ends_group(pp_group: list[int]) -> list[int]:
        """Megatron's embedding group of rank 0: the first and the last stage (:func:`pipeline_end_groups`)."""
        return [pp_group[0], pp_group[-1]] if len(pp_group) > 1 else pp_group

    def _group(self, ranks: list[int]) -> tuple[int, int]:
        return len(ranks), len({r // self.gpus_per_node for r in ranks})

    def _stage_ids(self, pp_rank: int) -> list[int]:
        if self.cand.pp == 1:
            return [0]
        return local_stage_ids(pp_rank, self.cand.pp, self.cand.vpp, self.cand.schedule or "1f1b")

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs."""
        return self._stages[pp_rank]

    def blocks_of(self, pp_rank: int) -> list[int]:
        """The block indices pipeline rank ``pp_rank`` holds."""
        return self._blocks[pp_rank]

    def ranges_of(self, pp_rank: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` block ranges of pipeline rank ``pp_rank``'s stages."""
        return self._ranges[pp_rank]

    def ends_of(self, pp_rank: int) -> tuple[bool, bool]:
        """``(holds the first stage, holds the last stage)``: the embedding, and the head and loss."""
        return self._ends[pp_rank]

    def pp_rank_of(self, rank: int) -> int:
        """The pipeline rank of global ``rank`` (its stages: :meth:`stages_of`)."""
        return self.layout.dense_grid.coords(rank)["pp"]

    def coordinates(self, rank: int) -> dict[str, int]:
        """Global ``rank``'s coordinate on each axis (``tp, cp, dp, pp``: the dense grid; ``ep, etp, edp``: the
        expert grid, when ep > 1; ``dp_shard, dp_replicate``: the mesh's split of dp).

        Raises:
            ValueError: ``rank`` is outside the world.
        """
        info = self.layout.rank_info(rank)
        mesh = self.layout.mesh_grid.coords(rank)
        expert = ("ep", "etp", "edp") if self.cand.ep > 1 else ()  # without experts: the dense grid's
        return {**{k: info[k] for k in ("tp", "cp", "pp", "dp", *expert)},
                "dp_shard": mesh.get("dp_shard", 0), "dp_replicate": mesh.get("dp_replicate", 0)}

    def shard_words(self) -> list[str]:
        """How the parameters divide over the axes that hold no part of them by themselves, in words: what FSDP2
        shards over (cp folded into the shard group), and cp without FSDP2 (the sequence split, parameters whole)."""
        c, out = self.cand, []
        dense = self.groups["dp_shard"].size if c.mode in ("fsdp", "hsdp") else 1
        if dense > 1:
            over = "dp_shard" + (" x cp" if c.cp > 1 else "") + (" x dp_replicate" if c.mode == "fsdp" and
                                                                  c.dp_replicate > 1 else "")
            out.append(f"FSDP2 shards the dense parameters over {over} ({dense} ranks)")
        elif c.cp > 1:
            out.append(f"cp {c.cp}: nothing to divide (cp splits the sequence; every cp rank holds the parameters "
                       f"whole)")
        if self.layout.edp > 1 and c.mode != "ddp" and c.ep > 1:
            out.append(f"FSDP2 shards the experts over edp ({self.layout.edp} ranks)")
        return out
