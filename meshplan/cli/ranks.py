"""``meshplan ranks`` and ``meshplan schema``: torch-free (they never import torch)."""

from __future__ import annotations

import argparse
import json
import sys

from meshplan.cli.args import add_layout_flags, int_arg, layout_from_args, write_output

__all__ = ["register", "MAX_TABLE_RANKS"]

#: ``meshplan ranks`` refuses larger worlds: the JSON of 2**16 ranks is 16 MB and takes ~2.5 s on a laptop
#: core; 2**20 ranks would be 280 MB (svg: 1 GB) and take a minute.
MAX_TABLE_RANKS = 1 << 16


def _ranks(args: argparse.Namespace) -> int:
    from meshplan.mesh.rank_table import render
    resolved = layout_from_args(args).resolve(args.world_size)
    out = render(resolved, args.format, args.gpus_per_node)
    write_output(out if isinstance(out, bytes) or out.endswith("\n") else out + "\n", args.output)
    return 0


def _schema(args: argparse.Namespace) -> int:
    from meshplan.plan_file.json_schema import plan_schema
    sys.stdout.write(json.dumps(plan_schema(), indent=2) + "\n")
    return 0


def register(sub) -> None:
    """Add ``ranks`` and ``schema`` to the ``meshplan`` subparsers."""
    r = sub.add_parser("ranks", help="groups and per-rank coordinates of a layout (Megatron-exact)")
    add_layout_flags(r, world_required=True, max_world=MAX_TABLE_RANKS,
                     why=" (2**16: the tables of larger worlds take minutes and gigabytes to print)")
    r.add_argument("--format", choices=("table", "json", "svg", "png"), default="table",
                   help="svg/png: the rank grid, one panel per group kind (png needs meshplan[viz])")
    r.add_argument("--gpus-per-node", type=int_arg(1, MAX_TABLE_RANKS, " (2**16)"), default=None,
                   help="ranks per node: svg/png mark node boundaries and count groups that span nodes")
    r.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    r.set_defaults(func=_ranks)
    s = sub.add_parser("schema", help="print the JSON Schema of plan files")
    s.set_defaults(func=_schema)
