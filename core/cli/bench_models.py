"""The bench's layer stacks: the presets' shapes and the layers they build.

Two kinds of layer: the toy GPT :class:`~graphslot.cli.toy.Block` (presets default,
launch, tiny) and HuggingFace transformers' ``LlamaDecoderLayer`` (preset llama, the
``models`` extra), wrapped in :class:`LlamaLayer` so that, like a Block, it takes one
tensor and returns one. :class:`CheckpointedLayer` wraps either for the checkpoint peers.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .toy import Block, GPTConfig

__all__ = ["BenchShape", "LlamaLayer", "CheckpointedLayer", "make_layers", "training_data",
           "transformers_missing", "MODELS_EXTRA"]

#: the extra that brings transformers for the llama preset
MODELS_EXTRA = "graphslot[models]"


@dataclass
class BenchShape(GPTConfig):
    """The bench's layer stack: a :class:`~graphslot.cli.toy.GPTConfig` (the layers run
    in its ``dtype``; ``vocab`` is unused), made from a preset by :meth:`preset`.

    Attributes:
        model: ``"gpt"`` (toy Blocks) or ``"llama"`` (transformers' LlamaDecoderLayer,
            ``ffn`` its intermediate size).
        kv_heads: the llama layers' key/value heads (grouped-query attention); None for gpt.
    """

    model: str = "gpt"
    kv_heads: int | None = None

    #: Preset name -> the fields that differ from GPTConfig's defaults.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "default": dict(hidden=4096, heads=32, ffn=16384, seq=4096, batch=1, layers=8,
                        dtype=torch.bfloat16, attention="sdpa"),
        # small layers, many of them: launch-bound, where graphs pay
        "launch": dict(hidden=256, heads=4, ffn=1024, seq=128, batch=4, layers=32,
                       dtype=torch.bfloat16, attention="sdpa"),
        # CI size
        "tiny": dict(hidden=64, heads=4, ffn=128, seq=32, batch=2, layers=3,
                     dtype=torch.float32, attention="math"),
        # eight Llama-3-8B decoder layers at sequence 8192 (issue 29's stack)
        "llama": dict(model="llama", hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192,
                      batch=1, layers=8, dtype=torch.bfloat16, attention="sdpa"),
    }

    @staticmethod
    def preset(name: str) -> BenchShape:
        """The shape of preset ``name``.

        Raises:
            ValueError: ``name`` is not one of :attr:`PRESETS`.
        """
        if name not in BenchShape.PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose {', '.join(BenchShape.PRESETS)}")
        return BenchShape(**BenchShape.PRESETS[name])

    def as_dict(self) -> dict[str, Any]:
        """The shape as the report gives it: every field but ``vocab``, the dtype by name."""
        d = {k: v for k, v in asdict(self).items() if k != "vocab"}
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d

    def weight_bytes(self) -> int:
        """The layers' parameters' bytes (their matrices; norms and biases are small)."""
        h, f = self.hidden, self.ffn
        if self.model == "llama":
            kv = (self.kv_heads or self.heads) / self.heads
            per_layer = int(h * h * (2 + 2 * kv)) + 3 * h * f
        else:
            per_layer = 4 * h * h + 2 * h * f
        return per_layer * self.layers * self.dtype.itemsize

    def boundary_bytes(self) -> int:
        """One activation between layers (``batch x seq x hidden``): the step holds the
        stack's input and its output at least."""
        return self.batch * self.seq * self.hidden * self.dtype.itemsize

    def check(self) -> None:
        """``ValueError`` naming the option of a field out of range for this model."""
        for k in ("hidden", "heads", "ffn", "seq", "batch", "layers"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k} must be at least 1, got {getattr(self, k)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads}")
        if self.model == "gpt":
            if self.kv_heads is not None:
                raise ValueError("--kv-heads applies to --preset llama only (the gpt blocks "
                                 "have as many key/value heads as heads)")
            return
        kv = self.kv_heads or self.heads
        if kv < 1 or self.heads % kv:
            raise ValueError(f"--kv-heads must divide --heads {self.heads}, got {kv}")
        if self.attention != "sdpa":
            raise ValueError("--preset llama runs sdpa attention only (transformers' eager "
                             "attention is not causal without a mask)")


def transformers_missing() -> str | None:
    """Why the llama preset cannot run here, or None when transformers' Llama imports."""
    try:
        importlib.import_module("transformers")
        importlib.import_module("transformers.models.llama.modeling_llama")
    except ImportError as e:
        return (f"--preset llama needs transformers ({e}); install it with: "
                f"pip install '{MODELS_EXTRA}'")
    return None


class LlamaLayer(nn.Module):
    """One ``LlamaDecoderLayer`` over a fixed sequence: one tensor in, one out.

    The rotary embedding's cos and sin for that sequence are buffers of this module, so
    graphslot treats them as module state (fixed addresses, like parameters). Attention
    is causal: with no mask transformers' sdpa attention passes ``is_causal``.

    Args:
        layer: the decoder layer.
        cos: the rotary cos, ``(batch, seq, head_dim)``.
        sin: the rotary sin, the same shape.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x, position_embeddings=(self.cos, self.sin))
        # transformers < 4.54 returns a tuple (hidden states first), newer ones the tensor
        return out[0] if isinstance(out, tuple) else out


class CheckpointedLayer(nn.Module):
    """``layer`` under ``torch.utils.checkpoint`` (non-reentrant): its forward saves only
    its input, and its backward runs the forward again.

    Args:
        layer: the layer.
        preserve_rng_state: checkpoint's own (default True). Graph capture needs False:
            the device's RNG state cannot be read while a graph is captured, and the
            bench's layers draw no random numbers.
    """

    def __init__(self, layer: nn.Module, preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.layer = layer
        self.preserve_rng_state = preserve_rng_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = checkpoint(self.layer, x, use_reentrant=False,
                         preserve_rng_state=self.preserve_rng_state)
        assert isinstance(out, torch.Tensor)
        return out


def make_layers(shape: BenchShape, device: torch.device) -> list[nn.Module]:
    """``shape.layers`` layers in ``shape.dtype`` on ``device``, seeded (seed 0).

    Blocks are made on the host and moved (the same weights on every backend); Llama
    layers are made on ``device`` (a host-side init of eight of them takes a while).

    Raises:
        ValueError: the llama preset without transformers.
    """
    torch.manual_seed(0)
    if shape.model == "gpt":
        return [Block(shape).to(device=device, dtype=shape.dtype) for _ in range(shape.layers)]
    why = transformers_missing()
    if why:
        raise ValueError(why)
    hf: Any = importlib.import_module("transformers")
    llama: Any = importlib.import_module("transformers.models.llama.modeling_llama")
    config = hf.LlamaConfig(hidden_size=shape.hidden, num_attention_heads=shape.heads,
                            num_key_value_heads=shape.kv_heads or shape.heads,
                            intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                            max_position_embeddings=shape.seq, attn_implementation="sdpa")
    config._attn_implementation = "sdpa"  # what older versions read
    with torch.device(device):
        rotary = llama.LlamaRotaryEmbedding(config=config)
        probe = torch.empty(0, dtype=shape.dtype)  # rotary casts cos and sin to its dtype
        positions = torch.arange(shape.seq).expand(shape.batch, -1)
        cos, sin = rotary(probe, positions)
        layers: list[nn.Module] = []
        for i in range(shape.layers):
            layer = llama.LlamaDecoderLayer(config, i).to(dtype=shape.dtype)
            layers.append(LlamaLayer(layer, cos, sin))
    return layers


def training_data(shape: BenchShape, device: torch.device
                  ) -> tuple[list[nn.Module], torch.Tensor, torch.Tensor]:
    """The bench's layers (:func:`make_layers`), an input that wants its gradient and the
    output's gradient, drawn from a seeded host generator: the same data on every backend."""
    layers = make_layers(shape, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape.batch, shape.seq, shape.hidden, generator=g).to(device, shape.dtype)
    x.requires_grad_()
    gy = torch.randn(x.shape, generator=g).to(device, shape.dtype)
    return layers, x, gy
