"""The models ``ddl-perf train`` measures, written here because torchvision does not import
beside the torch we ship with: ResNet-50 (torchvision's ``resnet50``, v1.5: the stride on
the 3x3 convolution) and a GPT-2-shaped decoder (pre-norm blocks, causal attention, a
language-model head tied to the token embedding).

Their sizes follow from formulas the tests check: a GPT-2 block of width ``d`` has
``12 d^2 + 13 d`` parameters (7,087,872 at d = 768), the whole model adds ``vocab x d +
context x d + 2 d``; ResNet-50 has 25,557,032.

Each ``ModelSpec`` also says what one sample is (an image, or ``seq_len`` tokens), so
throughput can be given in the unit people quote: images/s or tokens/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What to build: ``name`` (``resnet50`` or ``gpt2``) and its shape knobs. ``width``:
    the stem width of the ResNet (64) or the model width of GPT-2 (768)."""

    name: str
    width: int | None = None
    layers: int = 12  # gpt2: transformer blocks
    heads: int = 12  # gpt2: attention heads (width must be a multiple)
    seq_len: int = 1024  # gpt2: tokens per sample (and the position table)
    vocab: int = 50257  # gpt2
    image_size: int = 224  # resnet50: input images are image_size x image_size x 3
    classes: int = 1000  # resnet50

    @property
    def model_width(self) -> int:
        return self.width or (64 if self.name == "resnet50" else 768)

    @property
    def unit(self) -> str:
        """What throughput counts: ``images`` or ``tokens``."""
        return "images" if self.name == "resnet50" else "tokens"

    @property
    def units_per_sample(self) -> int:
        return 1 if self.name == "resnet50" else self.seq_len

    def describe(self) -> str:
        if self.name == "resnet50":
            w = "" if self.model_width == 64 else f", stem width {self.model_width}"
            return f"resnet50 ({self.image_size}x{self.image_size} images{w})"
        return (f"gpt2 ({self.layers} layers, width {self.model_width}, {self.heads} heads, "
                f"{self.seq_len} tokens, vocab {self.vocab})")

    def validate(self) -> None:
        if self.name not in MODELS:
            raise ValueError(f"--model {self.name!r}: choose one of {', '.join(MODELS)}")
        if self.model_width < 1 or self.layers < 1 or self.seq_len < 1 or self.vocab < 2:
            raise ValueError("--width, --layers, --seq-len must be >= 1 and --vocab >= 2")
        if self.name == "gpt2" and self.model_width % self.heads:
            raise ValueError(f"--width {self.model_width} is not a multiple of "
                             f"--heads {self.heads}")
        if self.name == "resnet50" and self.image_size < 32:
            raise ValueError(f"--image-size {self.image_size}: ResNet-50 halves it 5 times; "
                             "give at least 32")


MODELS = ("resnet50", "gpt2")


def gpt2_block_params(width: int) -> int:
    """Two layer norms (2 x 2d), attention (qkv 3d^2 + 3d, projection d^2 + d) and the
    MLP (d x 4d + 4d, 4d x d + d)."""
    return 12 * width * width + 13 * width


def gpt2_params(width: int, layers: int, vocab: int, context: int) -> int:
    """Blocks, token and position embeddings and the final layer norm; the head is tied to
    the token embedding, so it adds nothing."""
    return layers * gpt2_block_params(width) + vocab * width + context * width + 2 * width


def count_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def build(spec: ModelSpec) -> Any:
    """The torch module of ``spec`` (seeded: every rank builds the same weights)."""
    import torch

    spec.validate()
    torch.manual_seed(0)
    if spec.name == "resnet50":
        return _resnet(spec.model_width, (3, 4, 6, 3), spec.classes)
    return _gpt2(spec)


def synthetic_batch(spec: ModelSpec, batch: int, seed: int) -> tuple[Any, Any]:
    """One batch of inputs and targets of the right shape, on the CPU."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if spec.name == "resnet50":
        x = torch.randn(batch, 3, spec.image_size, spec.image_size, generator=g)
        return x, torch.randint(0, spec.classes, (batch,), generator=g)
    tokens = torch.randint(0, spec.vocab, (batch, spec.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss(spec: ModelSpec, out: Any, target: Any) -> Any:
    import torch

    if spec.name == "resnet50":
        return torch.nn.functional.cross_entropy(out.float(), target)
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]),
                                             target.reshape(-1))


# ------------------------------------------------------------------------- ResNet-50
def _resnet(width: int, blocks: Sequence[int], classes: int) -> Any:
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, inplanes: int, planes: int, stride: int) -> None:
            super().__init__()
            out = planes * self.expansion
            self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or inplanes != out:
                self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride,
                                                          bias=False), nn.BatchNorm2d(out))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + (x if self.downsample is None else self.downsample(x)))

    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
                               nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, stride=2, padding=1)]
    inplanes = width
    for stage, count in enumerate(blocks):
        planes = width * 2**stage
        for i in range(count):
            layers.append(Bottleneck(inplanes, planes, 2 if i == 0 and stage > 0 else 1))
            inplanes = planes * Bottleneck.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, classes)]
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


# ---------------------------------------------------------------------------- GPT-2
def _gpt2(spec: ModelSpec) -> Any:
    import torch
    from torch import nn

    d, heads = spec.model_width, spec.heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            att = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(spec.vocab, d)
            self.wpe = nn.Embedding(spec.seq_len, d)
            self.blocks = nn.ModuleList(Block() for _ in range(spec.layers))
            self.ln_f = nn.LayerNorm(d)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.wte.weight.t()  # the tied head

    return GPT2()
