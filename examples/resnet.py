"""A small ResNet-style image classifier: a model that is not a block stack.

No parallelism lives here: this is the ordinary ``nn.Module`` a pipeline cuts at named modules by tracing
(``meshplan.pipeline.trace``), as the seeds' example cut torchvision's ResNet50 into ``seq1`` (stem,
``layer1``, ``layer2``) on one GPU and ``seq2`` (``layer3``, ``layer4``, pool) plus ``fc`` on another. The
module names follow torchvision: ``conv1``, ``norm1`` (torchvision's ``bn1``), ``act``, ``layer<i>.<j>``
(basic residual blocks with ``conv1``, ``norm1``, ``conv2``, ``norm2`` and, where the shape changes,
``downsample``), ``avgpool``, ``fc``. The stages are not alike (channels double and the resolution halves from
one to the next), so it is not a stack of identical blocks to deal out by count.

Why GroupNorm and not BatchNorm: BatchNorm normalises with the statistics of the batch it sees, so a pipeline
that runs microbatches (a quarter of the batch each) computes other activations, other gradients and other
running statistics than one device running the whole batch: pipeline training would not equal one-device
training, whatever the schedule. GroupNorm normalises each sample on its own (over groups of channels), so the
result per sample does not depend on the batch and any split into microbatches computes the same loss and
gradients (up to fp32 summation order). It has no running buffers either: the state dict is parameters only.

Why SiLU and not ReLU by default: ReLU's kink makes training chaotic at fp32 noise. A pre-activation within
rounding of zero (4e-9 was seen) is on one side of the kink on one device and on the other when the gradients
were summed in another order one step earlier (microbatches); AdamW's per-element normalisation turns that one
flipped pixel into a visible update. Measured on ``tiny_args()``, one device with one thread (as under
torchrun), AdamW(lr=1e-2), full batch vs two microbatches: gradients 1e-6 apart at the first step, 3.6% apart
(one GroupNorm bias) at the second, 12% at the third; with SiLU they stay within 2e-6. Layout-invariance tests
need the smooth one; ``activation="relu"`` gives the torchvision one.

Sized for CPU tests: 32×32 inputs, widths 16-32-64 by default, about 0.2M parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ResNetArgs", "BasicBlock", "ResNet", "build", "tiny_args"]


@dataclass
class ResNetArgs:
    """Model configuration: ``widths[i]`` channels and ``depths[i]`` blocks in ``layer<i+1>`` (each layer after
    the first halves the resolution); ``groups`` GroupNorm groups (must divide every width); ``activation``
    ``"silu"`` or ``"relu"``."""

    in_channels: int = 3
    widths: tuple[int, ...] = (16, 32, 64)
    depths: tuple[int, ...] = (2, 2, 2)
    num_classes: int = 10
    groups: int = 4
    activation: str = "silu"  # or "relu" (see the module docstring)


def _activation(name: str) -> nn.Module:
    if name not in ("silu", "relu"):
        raise ValueError(f"activation {name!r}; expected 'silu' or 'relu'")
    return nn.SiLU() if name == "silu" else nn.ReLU()


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with GroupNorm, an activation and a residual connection (a 1×1 projection when the
    shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int, activation: str = "silu") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.act = _activation(activation)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.GroupNorm(groups, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.act(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.act(out + identity)


class ResNet(nn.Module):
    """Stem (3×3 conv, GroupNorm, activation), ``layer1`` … ``layerN`` of :class:`BasicBlock`, global average pool,
    ``fc``.

    Deterministic: ``torch.manual_seed(s); ResNet(args)`` gives the same weights every time (Kaiming-normal
    convolutions, GroupNorm weight one and bias zero, ``fc`` normal(0, 0.02) with zero bias).

    Shape:
        - Input: :math:`(b, C_{in}, H, W)` images, e.g. :math:`(b, 3, 32, 32)`.
        - Output: :math:`(b, \\text{num_classes})` logits.
    """

    def __init__(self, args: ResNetArgs | None = None) -> None:
        super().__init__()
        args = args or ResNetArgs()
        if len(args.widths) != len(args.depths) or any(w % args.groups for w in args.widths):
            raise ValueError(f"need len(widths) == len(depths) and groups | every width; got {args}")
        self.args = args
        self.conv1 = nn.Conv2d(args.in_channels, args.widths[0], 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(args.groups, args.widths[0])
        self.act = _activation(args.activation)
        c_in = args.widths[0]
        for i, (width, depth) in enumerate(zip(args.widths, args.depths)):
            blocks = [BasicBlock(c_in if j == 0 else width, width, 2 if (i > 0 and j == 0) else 1, args.groups,
                                 args.activation) for j in range(depth)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            c_in = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, args.num_classes)
        self.init_weights()

    @property
    def layers(self) -> list[nn.Sequential]:
        """``layer1`` … ``layerN`` in order."""
        return [getattr(self, f"layer{i + 1}") for i in range(len(self.args.depths))]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter from the current RNG state (in module order)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.conv1(x)))
        for layer in self.layers:
            x = layer(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def tiny_args(**overrides) -> ResNetArgs:
    """A smaller config for tests: widths 8-16-32, one block per layer, 4 classes."""
    base = dict(widths=(8, 16, 32), depths=(1, 1, 1), num_classes=4, groups=4)
    return ResNetArgs(**{**base, **overrides})


def build(args: ResNetArgs | None = None, seed: int = 0) -> ResNet:
    """``torch.manual_seed(seed); ResNet(args)`` on the current default device."""
    torch.manual_seed(seed)
    return ResNet(args)
