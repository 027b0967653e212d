"""What the ``meshplan`` subcommands share: the one-line-error parser, bounded integers and the layout flags."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from meshplan.errors import PlanError

__all__ = ["Parser", "int_arg", "float_arg", "add_layout_flags", "layout_from_args", "error_line", "write_output"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2: `meshplan: error: estimate: …`, the command once
        where = self.prog.removeprefix("meshplan").strip()
        raise PlanError(f"{where}: {message}" if where else message)


def int_arg(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]``; the error names the bound (and ``why``)."""
    def parse(text: str) -> int:
        shown = text if len(text) <= 40 else f"{text[:40]}… ({len(text)} characters)"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {shown!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}]{why}, got {shown}")
        return value
    return parse


def float_arg(lo: float, hi: float, unit: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``(lo, hi]`` (NaN, ±inf and ``lo`` itself refused)."""
    def parse(text: str) -> float:
        shown = text if len(text) <= 40 else f"{text[:40]}… ({len(text)} characters)"
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {shown!r}") from None
        if not lo < value <= hi:  # False for NaN
            raise argparse.ArgumentTypeError(f"expected a number in ({lo:g}, {hi:.0f}]{unit}, got {shown}")
        return value
    return parse


def add_layout_flags(p: argparse.ArgumentParser, world_required: bool, max_world: int | None = None,
                      why: str = " (2**20)") -> None:
    from meshplan.plan_file.layout import MAX_RANKS
    hi = max_world or MAX_RANKS
    p.add_argument("--world-size", type=int_arg(1, hi, why), required=world_required,
                   help=f"number of ranks, 1 to {hi}")
    for name, help_ in [("tp", "tensor parallel"), ("pp", "pipeline parallel"), ("cp", "context parallel"),
                        ("ep", "expert parallel"), ("etp", "expert tensor parallel (default: tp)"),
                        ("vpp", "virtual stages per pp rank"), ("dp-replicate", "dp replicas"),
                        ("dp-shard", "dp sharding degree (-1: inferred)")]:
        lo = -1 if name == "dp-shard" else 1
        p.add_argument(f"--{name}", type=int_arg(lo, MAX_RANKS, " (2**20)"), default=None, help=help_)
    p.add_argument("--order", default=None, help="Megatron order, innermost first (default tp-cp-ep-dp-pp)")


def layout_from_args(args: argparse.Namespace, base: dict | None = None):
    """A Layout from the layout flags, over ``base`` (a plan's layout section)."""
    from meshplan.plan_file.layout import Layout
    from meshplan.plan_file.reading import pydantic_message
    data = dict(base or {})
    for k in ("tp", "pp", "cp", "ep", "etp", "vpp", "dp_replicate", "dp_shard", "order"):
        v = getattr(args, k, None)
        if v is not None:
            data[k] = v
    try:
        return Layout.model_validate(data)
    except Exception as e:
        raise PlanError(pydantic_message(e)) from None


def error_line(message: str) -> str:
    """The one stderr line of a failure: every run of whitespace (newlines included) becomes one space."""
    return f"meshplan: error: {' '.join(message.split())}"


def write_output(data: str | bytes, output: str | None) -> None:
    """Write a command's result to ``output`` (a file path: then ``meshplan: wrote FILE (N bytes)`` on stderr), or
    to stdout (bytes: its binary buffer).

    Raises:
        PlanError: ``output`` is a directory or cannot be written (one line: the path and why).
    """
    if output is None:
        if isinstance(data, bytes):
            if sys.stdout.isatty():
                raise PlanError("--format png writes binary data: pass -o FILE.png or redirect stdout to a file")
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(data)
        return
    out = Path(output)
    if out.is_dir():
        raise PlanError(f"-o {output!r}: is a directory, expected a file path")
    try:
        if isinstance(data, bytes):
            out.write_bytes(data)
        else:
            out.write_text(data, encoding="utf-8")
    except (OSError, ValueError) as e:  # missing folder, no permission, a NUL in the path, a full disk
        raise PlanError(f"-o {output!r}: cannot write: {getattr(e, 'strerror', None) or e}") from None
    print(f"meshplan: wrote {output} ({_size(out.stat().st_size)})", file=sys.stderr)


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"
