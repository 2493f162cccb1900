"""What graphslot's Megatron-Core adapter (:mod:`graphslot.adapters.megatron`) checks
before it hooks in: the Megatron-Core version and the symbols it wraps
(:func:`check_megatron`), and the model's configuration (:func:`check_config`). Imports
no other adapter module."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from graphslot.errors import IncompatibleError

__all__ = ["MIN_VERSION", "FP8_RECIPES_SERVED", "MegatronInfo", "check_megatron", "check_config"]

#: The first Megatron-Core release with the local-graph record and fine-grained offload this
#: adapter is written against.
MIN_VERSION = (0, 16, 0)

_NEEDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("megatron.core.transformer.cuda_graphs",
     ("_CudagraphGlobalRecord", "_CudaGraphRunner", "CudaGraphManager", "is_graph_capturing",
      "is_graph_warmup", "delete_cuda_graphs")),
    ("megatron.core.transformer.transformer_layer", ("TransformerLayer",)),
)
RUNNER_NEEDS = ("func", "create_bwd_graph", "replay_graph_capture")


@dataclass(frozen=True)
class MegatronInfo:
    """What :func:`check_megatron` found."""

    version: str
    cuda_graphs: Any  #: the ``megatron.core.transformer.cuda_graphs`` module
    transformer_layer: type  #: ``TransformerLayer``


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def check_megatron(min_version: tuple[int, ...] = MIN_VERSION) -> MegatronInfo:
    """Import Megatron-Core and check that it has what the adapter hooks into.

    Args:
        min_version: the oldest Megatron-Core version accepted.

    Returns:
        What was found (:class:`MegatronInfo`: version and the hooked symbols).

    Raises:
        IncompatibleError: naming the missing package, the version found, or each
            missing symbol.
    """
    need = ".".join(map(str, min_version))
    try:
        core = importlib.import_module("megatron.core")
    except ImportError as e:
        raise IncompatibleError(f"Megatron-Core is not importable ({e}); install megatron-core>={need}") from e
    version = str(getattr(core, "__version__", "") or "unknown")
    if version == "unknown" or _version_tuple(version) < tuple(min_version):
        raise IncompatibleError(f"Megatron-Core {version} is too old: graphslot needs {need} or newer "
                                "(the local CUDA graph record and fine-grained offload it hooks into)")
    missing: list[str] = []
    mods: dict[str, Any] = {}
    for mod_name, names in _NEEDS:
        try:
            mods[mod_name] = mod = importlib.import_module(mod_name)
        except ImportError as e:
            missing.append(f"{mod_name} ({e})")
            continue
        missing += [f"{mod_name}.{n}" for n in names if not hasattr(mod, n)]
    if not missing:
        cg = mods["megatron.core.transformer.cuda_graphs"]
        rec = cg._CudagraphGlobalRecord
        for n in ("cudagraph_record", "cudagraph_created", "create_cudagraphs"):
            if not hasattr(rec, n):
                missing.append(f"_CudagraphGlobalRecord.{n}")
        if not isinstance(rec.__dict__.get("create_cudagraphs"), classmethod):
            missing.append("_CudagraphGlobalRecord.create_cudagraphs as a classmethod")
        missing += [f"_CudaGraphRunner.{n}" for n in ("create_bwd_graph", "replay_graph_capture")
                    if not hasattr(cg._CudaGraphRunner, n)]
    if missing:
        raise IncompatibleError(f"Megatron-Core {version} lacks what graphslot hooks into: " + ", ".join(missing))
    return MegatronInfo(version, mods["megatron.core.transformer.cuda_graphs"],
                        mods["megatron.core.transformer.transformer_layer"].TransformerLayer)


def _names(v: Any) -> set[str]:
    vals = v if isinstance(v, (list, tuple, set)) else [v]
    return {str(getattr(x, "name", x)) for x in vals if x not in (None, "")}


#: fp8 recipes (``TransformerConfig.fp8_recipe``) served with ``fp8`` set; see
#: :func:`_low_precision_problems` for why fp8 can be served and what is refused.
FP8_RECIPES_SERVED: tuple[str, ...] = ("delayed", "tensorwise")


def _low_precision_problems(config: Any) -> list[str]:
    """What of ``fp8``/``fp4`` graphslot refuses, and why.

    TransformerEngine (2.x) saves a quantized GEMM input for backward through
    ``prepare_for_saving``: a ``*TensorStorage`` is taken apart into plain tensors (the fp8
    bytes, a transpose, a per-tensor ``scale_inv``) that go through ``save_for_backward``, so
    through graphslot's pack hook, into a slot, like any activation. The scaling state
    (quantizers' ``scale``/``amax``, ``fp8_meta``'s amax history) lives in the modules and is
    reached from ``ctx`` by reference, outside the saved activations; offload never moves it.
    The cached fp8 weight (Megatron caches it across microbatches) is a ``Float8Tensor`` that
    ``Linear`` dedups out of its saved tensors and ``LayerNormLinear`` saves by reference; a
    saved tensor subclass stays on the device (:meth:`_Layer.keeps`), so it is never copied.
    So fp8 compute with high-precision parameters is served. Refused, as not verified (no run
    has checked them with graphslot):

    * fp8 recipes outside :data:`FP8_RECIPES_SERVED`, and ``fp4`` (mxfp8 and NVFP4 need
      Blackwell; this project's runs are on Hopper);
    * ``fp8_param``/``fp4_param``: parameters are then TE quantized tensors;
    * ``fp8_dot_product_attention``/``fp8_multi_head_attention``: fused attention then saves
      its fp8 q/k/v/output as ``Float8Tensor`` objects, which would stay on the device, so
      attention would not be offloaded.
    """
    problems: list[str] = []
    fp8, fp4 = getattr(config, "fp8", None), getattr(config, "fp4", None)
    served = ", ".join(repr(r) for r in FP8_RECIPES_SERVED) or "none"
    if fp8:
        recipe = getattr(config, "fp8_recipe", None) or "delayed"
        recipe = str(getattr(recipe, "value", recipe))
        if recipe not in FP8_RECIPES_SERVED:
            problems.append(f"fp8_recipe is {recipe!r}: not verified with graphslot slots (its saved "
                            f"tensors should be plain like the others', but no run has checked it); "
                            f"served fp8 recipes: {served}")
    for name in ("fp8_param", "fp4_param"):
        if getattr(config, name, False):
            problems.append(f"{name} is True: not verified with graphslot (parameters are then "
                            "TransformerEngine quantized tensors, and no run has checked them); keep "
                            "parameters in bf16/fp16/fp32 (fp8 compute is served)")
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(config, name, False):
            problems.append(f"{name} is True: not verified with graphslot (TransformerEngine's fp8 "
                            "attention saves its q/k/v and output as Float8Tensor objects, which "
                            "would stay on the device, not offloaded, and no run has checked it); "
                            "set it False")
    if fp4:
        problems.append(f"fp4 is set: NVFP4 needs Blackwell GPUs and has not been run with graphslot "
                        f"slots; train in fp8 (recipes {served}) or bf16/fp16/fp32")
    return problems


def check_config(config: Any) -> None:
    """Check a ``TransformerConfig`` against what the adapter serves.

    Args:
        config: the model's ``TransformerConfig``.

    Raises:
        IncompatibleError: listing every problem and what to set instead.
    """
    problems: list[str] = []
    impl = getattr(config, "cuda_graph_impl", None)
    if impl != "local":
        problems.append(f"cuda_graph_impl is {impl!r}: graphslot serves Megatron's local CUDA graphs; "
                        "set cuda_graph_impl='local'")
    partial = _names(getattr(config, "cuda_graph_scope", None)) - {"full"}
    partial |= _names(getattr(config, "cuda_graph_modules", None))
    if partial:
        problems.append(f"CUDA graphs capture part of a layer ({', '.join(sorted(partial))}): graphslot "
                        "offloads whole graphed layers; leave cuda_graph_scope (cuda_graph_modules) empty")
    if getattr(config, "fine_grained_activation_offloading", False):
        problems.append("fine_grained_activation_offloading is True: Megatron's own offload would run "
                        "beside graphslot's; set it False and choose layers with enable(layers=...)")
    if getattr(config, "cpu_offloading", False):
        problems.append("cpu_offloading is True: set it False (graphslot does the offload)")
    if getattr(config, "recompute_granularity", None) is not None:
        problems.append(f"recompute_granularity is {config.recompute_granularity!r}: recomputation "
                        "inside graphed layers is not supported with offload; set it None")
    problems += _low_precision_problems(config)
    if getattr(config, "delay_wgrad_compute", False):
        problems.append("delay_wgrad_compute is True: TransformerEngine then computes weight "
                        "gradients after the backward graph (backward_dw), from saved inputs that "
                        "graphslot has already handed to the next layer's slot; set it False")
    if int(getattr(config, "gtp_weight_remat_size", 1) or 1) > 1:
        problems.append("gtp_weight_remat_size > 1: runners on their own streams are not supported")
    if problems:
        raise IncompatibleError("this Megatron-Core configuration is not supported by graphslot:\n  - "
                                + "\n  - ".join(problems))
