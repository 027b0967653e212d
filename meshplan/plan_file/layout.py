"""The parallel layout: degrees per axis and their order, validated and resolved.

``Layout`` is what a plan file says (``tp: 4``, ``order: tp-cp-ep-dp-pp`` …);
``Layout.resolve(world_size)`` checks it against a world size with Megatron-LM's
rules and returns a ``ResolvedLayout`` holding every derived size and the rank
grids (see :mod:`meshplan.mesh.ranks`). No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pydantic import Field, field_validator

from meshplan.errors import PlanError
from meshplan.mesh.ranks import AXES, RankGrid, divisors, pipeline_end_groups
from meshplan.plan_file.strict import Strict

__all__ = ["Layout", "ResolvedLayout", "GROUP_KINDS", "SMP_ALIASES", "MAX_RANKS"]

#: Upper bound of every degree and of the world size: 2**20 = 1,048,576 ranks, ten times today's largest jobs.
#: Rank tables are built in memory, so an unbounded size (``tp: 100000000``) would exhaust it instead of failing.
MAX_RANKS = 1 << 20
_AT_MOST = "; at most 1048576 (2**20), as is the world size."

#: smp's placement strategies. In smp's strings the right-most letter is the
#: innermost axis; ``cluster`` is smp's default ``DPT``, ``spread`` is ``TPD``.
SMP_ALIASES = {"cluster": "DPT", "spread": "TPD"}
_SMP_LETTERS = {"D": "dp", "P": "pp", "T": "tp"}

#: Megatron's group kinds (``tp-pp`` is its model-parallel group, ``tp-dp`` smp's DP_GROUP).
GROUP_KINDS = (
    "tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-cp", "tp-dp-cp",
    "ep", "etp", "edp", "etp-ep", "etp-ep-pp", "embd", "pos_embd",
)
_EXPERT_TOKEN = {"tp": "etp", "cp": "cp", "ep": "ep", "dp": "edp", "pp": "pp"}


def _fmt(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


def _parse_order(raw: str) -> tuple[str, ...]:
    text = raw.strip()
    alias = SMP_ALIASES.get(text.lower(), text)
    if alias and set(alias) <= set(_SMP_LETTERS) and len(alias) == len(set(alias)) and "-" not in alias:
        return tuple(_SMP_LETTERS[c] for c in reversed(alias))  # smp: right-most letter is innermost
    tokens = tuple(t.strip() for t in text.split("-"))
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise ValueError(
            f"order {raw!r} has unknown token(s) {unknown}; tokens are {', '.join(AXES)} joined by '-' "
            f"(innermost first), or smp's {', '.join(SMP_ALIASES)} / a permutation of D, P, T"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order {raw!r} repeats {repeated}")
    return tokens


class Layout(Strict):
    """Parallel degrees and their placement on ranks.

    Example::

        >>> Layout(tp=4, pp=2).resolve(16).dp
        2
    """

    tp: int = Field(1, ge=1, le=MAX_RANKS, description=f"Tensor-parallel degree (Megatron's "
                    f"tensor_model_parallel_size){_AT_MOST}")
    cp: int = Field(1, ge=1, le=MAX_RANKS,
                    description=f"Context-parallel degree: the sequence is split over cp ranks{_AT_MOST}")
    ep: int = Field(1, ge=1, le=MAX_RANKS, description=f"Expert-parallel degree for MoE layers{_AT_MOST}")
    etp: int | None = Field(
        None, ge=1, le=MAX_RANKS, description=f"Expert tensor-parallel degree; default: tp, as in Megatron-LM{_AT_MOST}"
    )
    pp: int = Field(1, ge=1, le=MAX_RANKS, description=f"Pipeline-parallel degree (number of stages){_AT_MOST}")
    vpp: int = Field(1, ge=1, le=MAX_RANKS,
                     description=f"Virtual pipeline stages per pp rank (interleaved schedules); needs pp > 1{_AT_MOST}")
    dp_replicate: int = Field(1, ge=1, le=MAX_RANKS,
                              description=f"Data-parallel replicas (DDP, or HSDP's replicate axis){_AT_MOST}")
    dp_shard: int = Field(
        -1, ge=-1, le=MAX_RANKS,
        description=f"Data-parallel sharding degree (FSDP); -1 infers it from the world size{_AT_MOST}"
    )
    order: str = Field(
        "tp-cp-ep-dp-pp",
        description=(
            "Megatron order string, innermost axis first (tp varies fastest in the default). "
            "smp placement names are accepted: 'cluster' (=DPT), 'spread' (=TPD) or any permutation "
            "of D, P, T, where the right-most letter is innermost."
        ),
    )

    @field_validator("order")
    @classmethod
    def _check_order(cls, v: str) -> str:
        _parse_order(v)
        return v

    @field_validator("dp_shard")
    @classmethod
    def _check_dp_shard(cls, v: int) -> int:
        if v == 0:
            raise ValueError("dp_shard must be -1 (inferred) or >= 1, got 0")
        return v

    def smallest_world(self) -> int:
        """The fewest ranks it runs on: tp·cp·pp times the dp degrees it fixes (``dp_shard: -1`` counts 1)."""
        return self.tp * self.cp * self.pp * self.dp_replicate * max(self.dp_shard, 1)

    def resolve(self, world_size: int) -> "ResolvedLayout":
        """Check the layout against ``world_size`` and derive every size.

        Raises:
            PlanError: a rule of Megatron-LM's is broken; the message names the
                fields, their numbers and, where one exists, the valid values.
        """
        if type(world_size) is not int or not 1 <= world_size <= MAX_RANKS:
            raise PlanError(f"world_size must be an integer in [1, {MAX_RANKS}] (2**20), got {world_size!r}")
        etp = self.tp if self.etp is None else self.etp
        dp = self._dense_dp(world_size)
        edp = self._expert_dp(world_size, etp)
        dp_shard = self._dp_shard(world_size, dp)
        order = self._full_order(dp, etp, edp)
        if self.vpp > 1 and self.pp == 1:
            raise PlanError(f"vpp({self.vpp}) needs pp > 1, got pp(1)")
        resolved = ResolvedLayout(
            world_size=world_size, tp=self.tp, cp=self.cp, ep=self.ep, etp=etp, pp=self.pp, vpp=self.vpp, dp=dp,
            dp_replicate=self.dp_replicate, dp_shard=dp_shard, edp=edp, order=order,
        )
        dense, expert = resolved.dense_grid, resolved.expert_grid
        # equal pp strides <=> equal pp groups (a group is the ranks agreeing on r mod stride and r // (stride·pp))
        if self.pp > 1 and dense.strides[dense.order.index("pp")] != expert.strides[expert.order.index("pp")]:
            raise PlanError(
                f"order {self.order!r}: dense and expert pipeline groups differ for tp({self.tp}) cp({self.cp}) "
                f"dp({dp}) vs etp({etp}) ep({self.ep}) edp({edp}); put pp last in the order"
            )
        return resolved

    def _dense_dp(self, w: int) -> int:
        """The data-parallel degree of the dense layers: ``w / (tp·cp·pp)``, which must divide."""
        tp, cp, pp = self.tp, self.cp, self.pp
        dense = tp * cp * pp
        if w % dense:
            valid = [d for d in divisors(w) if w % (d * cp * pp) == 0]
            if cp * pp == 1:
                raise PlanError(f"tp({tp}) does not divide world_size({w}); valid tp: {_fmt(valid)}")
            valid_pp = [d for d in divisors(w) if w % (tp * cp * d) == 0]
            raise PlanError(
                f"tp({tp})·cp({cp})·pp({pp}) = {dense} does not divide world_size({w}); "
                f"valid tp: {_fmt(valid)}; valid pp: {_fmt(valid_pp)}"
            )
        return w // dense

    def _expert_dp(self, w: int, etp: int) -> int:
        """The data-parallel degree of the expert layers: ``w / (etp·ep·pp)``, which must divide."""
        expert = etp * self.ep * self.pp
        if w % expert:
            valid = [d for d in divisors(w) if w % (etp * d * self.pp) == 0]
            raise PlanError(
                f"etp({etp})·ep({self.ep})·pp({self.pp}) = {expert} does not divide world_size({w}); "
                f"valid ep: {_fmt(valid)}"
            )
        return w // expert

    def _dp_shard(self, w: int, dp: int) -> int:
        """``dp_shard`` given or inferred (``-1``), with ``dp_replicate · dp_shard == dp``."""
        dense = self.tp * self.cp * self.pp
        if self.dp_shard == -1:
            if dp % self.dp_replicate:
                raise PlanError(
                    f"dp_replicate({self.dp_replicate}) does not divide dp({dp}) = world_size({w}) / "
                    f"(tp·cp·pp = {dense}); valid dp_replicate: {_fmt(divisors(dp))}"
                )
            return dp // self.dp_replicate
        dp_shard = self.dp_shard
        if self.dp_replicate * dp_shard != dp:
            raise PlanError(
                f"dp_replicate({self.dp_replicate})·dp_shard({dp_shard}) = {self.dp_replicate * dp_shard} "
                f"!= dp({dp}) = world_size({w}) / (tp·cp·pp = {dense}); set dp_shard: -1 to infer it"
            )
        return dp_shard

    def _full_order(self, dp: int, etp: int, edp: int) -> tuple[str, ...]:
        """The order's tokens with the size-1 axes it leaves out appended (as Megatron does).

        Every axis of size > 1 must be in the order, and pp last when dense and expert dp differ.
        """
        tokens = _parse_order(self.order)
        sizes = {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": dp, "pp": self.pp}
        for name, size in [*sizes.items(), ("etp", etp), ("edp", edp)]:
            tok = {"etp": "tp", "edp": "dp"}.get(name, name)
            if size > 1 and tok not in tokens:
                raise PlanError(
                    f"order {self.order!r} lacks {tok!r} but {name}({size}) > 1; every axis of size > 1 must be "
                    f"in the order"
                )
        if self.pp > 1 and tokens[-1] != "pp" and edp != dp:
            raise PlanError(
                f"order {self.order!r} must end with pp when pp({self.pp}) > 1 and edp({edp}) != dp({dp}): "
                f"otherwise dense and expert pipeline groups differ"
            )
        return tokens + tuple(a for a in AXES if a not in tokens)


@dataclass(frozen=True)
class ResolvedLayout:
    """Every size of a layout checked against a world size, plus its rank grids.

    ``order`` is normalised: Megatron tokens, innermost first, with the axes
    the user left out (all of size 1) appended.
    """

    world_size: int
    tp: int
    cp: int
    ep: int
    etp: int
    pp: int
    vpp: int
    dp: int
    dp_replicate: int
    dp_shard: int
    edp: int
    order: tuple[str, ...]

    @property
    def order_str(self) -> str:
        return "-".join(self.order)

    def sizes(self) -> dict[str, int]:
        """Every degree by name."""
        return {k: getattr(self, k) for k in
                ("tp", "cp", "ep", "etp", "pp", "vpp", "dp", "dp_replicate", "dp_shard", "edp")}

    @cached_property
    def dense_grid(self) -> RankGrid:
        """Megatron's decoder grid (tp, cp, dp, pp; ep is 1 there)."""
        s = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        return RankGrid(self.order, tuple(s[a] for a in self.order))

    @cached_property
    def expert_grid(self) -> RankGrid:
        """Megatron's folded expert grid: the same order with tp→etp, cp→1, dp→edp."""
        s = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}
        return RankGrid(tuple(_EXPERT_TOKEN[a] for a in self.order), tuple(s[a] for a in self.order))

    @cached_property
    def mesh_grid(self) -> RankGrid:
        """The dense grid with dp split into ``dp_shard`` (inner) and ``dp_replicate`` (outer)."""
        names, sizes = [], []
        for a in self.order:
            if a == "ep":
                continue
            if a == "dp":
                names += ["dp_shard", "dp_replicate"]
                sizes += [self.dp_shard, self.dp_replicate]
            else:
                names.append(a)
                sizes.append(getattr(self, a))
        return RankGrid(tuple(names), tuple(sizes))

    def groups(self, kind: str) -> list[list[int]]:
        """Megatron's groups of ``kind`` (one of :data:`GROUP_KINDS`)."""
        if kind in ("embd", "pos_embd"):
            embd, pos = pipeline_end_groups(self.dense_grid.groups("pp"))
            return embd if kind == "embd" else pos
        if kind in ("ep", "etp", "edp", "etp-ep", "etp-ep-pp"):
            return self.expert_grid.groups(kind)
        if kind in GROUP_KINDS:
            return self.dense_grid.groups(kind)
        raise PlanError(f"unknown group kind {kind!r}; kinds: {', '.join(GROUP_KINDS)}")

    def smp_ranks(self, rank: int) -> dict[str, int]:
        """smp's ranks of ``rank``: tp_rank, pp_rank, rdp_rank, dp_rank (in tp×dp), mp_rank (in tp×pp)."""
        g = self.dense_grid
        c = g.coords(rank)
        return {
            "tp_rank": c["tp"], "pp_rank": c["pp"], "rdp_rank": c["dp"],
            "dp_rank": g.rank_in_group(rank, "tp-dp"), "mp_rank": g.rank_in_group(rank, "tp-pp"),
        }

    def rank_info(self, rank: int) -> dict[str, int]:
        """Everything the CLI prints for one rank: grid coordinates and smp ranks."""
        d, e = self.dense_grid.coords(rank), self.expert_grid.coords(rank)
        return {"rank": rank, "tp": d["tp"], "cp": d["cp"], "dp": d["dp"], "pp": d["pp"],
                "etp": e["etp"], "ep": e["ep"], "edp": e["edp"], **self.smp_ranks(rank)}

    def fingerprint(self) -> str:
        """A stable text of every size and the order, exchanged between ranks at start-up."""
        return ";".join(f"{k}={v}" for k, v in self.sizes().items()) + f";order={self.order_str};world={self.world_size}"
