"""``meshplan checkpoints`` (torch-free: the step folders and their manifests) and ``meshplan export`` (a checkpoint
to full safetensors files, in one process, without the model)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from meshplan.cli.args import int_arg
from meshplan.errors import PlanError

__all__ = ["register"]


def _folder(path: str) -> Path:
    """``path`` itself when it is a checkpoint, else the latest complete one under it."""
    from meshplan.checkpoint.directory import is_complete, latest_complete
    p = Path(path)
    if is_complete(p):
        return p
    latest = latest_complete(p)
    if latest is None:
        raise PlanError(f"{path}: neither a complete checkpoint nor a folder holding one (step-N with .metadata and "
                        f"meshplan.json)")
    return latest


def _list(args: argparse.Namespace) -> int:
    from meshplan.checkpoint.directory import MANIFEST, PARTIAL, complete_steps
    from meshplan.checkpoint.manifest import read_manifest_file
    root = Path(args.directory)
    if not root.is_dir():
        raise PlanError(f"{root}: no such directory")
    rows = []
    for step, p in complete_steps(root):
        m = read_manifest_file(p / MANIFEST)  # every field checked: a hand-edited one is one line naming it
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.saved_at))
        samples = m.data.samples_seen if m.data is not None else "-"
        rows.append(f"{p.name}  step {step}  saved {saved}  world {m.world_size}  layout {' '.join(str(m.layout).split())[:200]}  "
                    f"optimizer {m.optimizer}  samples {samples}")
    rows += [f"{p.name}  torn (ignored)" for p in sorted(root.iterdir()) if p.name.endswith(PARTIAL)]
    sys.stdout.write("\n".join(rows or [f"{root}: no checkpoints"]) + "\n")
    return 0


def _export(args: argparse.Namespace) -> int:
    import warnings

    from meshplan.checkpoint.export import checkpoint_to_safetensors
    src = _folder(args.checkpoint)
    with warnings.catch_warnings():  # torch's "torch.distributed is disabled … a single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        written = checkpoint_to_safetensors(src, args.output, max_shard_bytes=args.max_shard_bytes)
    for f in written:
        print(f)
    return 0


def register(sub) -> None:
    """Add ``checkpoints`` and ``export`` to the ``meshplan`` subparsers."""
    c = sub.add_parser("checkpoints", help="list the complete (and torn) checkpoints of a checkpoint directory")
    c.add_argument("directory")
    c.set_defaults(func=_list)
    e = sub.add_parser("export", help="a checkpoint's model as full safetensors files (no model, no GPU needed)")
    e.add_argument("checkpoint", help="a checkpoint folder, or a directory of them (the latest complete is used)")
    e.add_argument("output", help="folder for model.safetensors (or model-0000i-of-0000n + the index)")
    e.add_argument("--max-shard-bytes", type=int_arg(1, 1 << 50, " (2**50)"), default=5 * 2 ** 30,
                   help="bytes per file at most (default 5 GiB, transformers' default)")
    e.set_defaults(func=_export)
