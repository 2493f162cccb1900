"""TransformerEngine: TE's ``make_graphed_callables`` drawing from graphslot's graph pools.

    from graphslot.arena import VariantGraphs
    from graphslot.adapters import te as gs_te

    vg = VariantGraphs(backend, capacity=8 << 30)
    layers_cp2 = gs_te.make_graphed_callables(layers, args_cp2, variants=vg, variant="cp2",
                                              _order=order, sample_kwargs=kw_cp2)
    layers_cp4 = gs_te.make_graphed_callables(layers, args_cp4, variants=vg, variant="cp4",
                                              _order=order, sample_kwargs=kw_cp4)
    print(vg.stats())          # one physical pool, as large as the larger variant's

graphslot plugs into TransformerEngine only through TE's own arguments, detected from the
signature of the ``make_graphed_callables`` in use (TE's, or any function with its
keywords passed as ``te_make_graphed_callables``):

* ``pool=`` (TE >= 1.12): with ``variants=`` and ``variant=``, every graph TE captures
  draws from that variant's region of a :class:`~graphslot.arena.VariantGraphs`, so K
  mutually exclusive variants (context-parallel sizes, sequence buckets) share one
  physical allocation as large as the largest variant's pool, exactly as
  ``VariantGraphs.capture`` does for graphslot's own captures.
* ``pre_warmup_hook=`` / ``post_warmup_hook=`` (TE >= 2.14): graphslot's hooks run first,
  then the caller's. Before the warm-up graphslot checks that no capture is under way; after
  it, it collects garbage and keeps the collector off until TE returns
  (:func:`graphslot.backend.no_gc`), so no reference cycle holding device tensors is freed
  in the middle of a capture (TE before 2.7 did not pause the collector itself). Without
  hook support the same is done once, before TE is called.
* ``capture_time_hooks=`` (TE 2.19), ``_order``, ``sample_kwargs`` and every other TE
  argument pass through untouched; one the function does not accept is refused with the
  TE version that introduced it.
* the ``cuda_graph_stream`` / ``cuda_graph_event`` keywords that TE >= 2.14 graphed
  callables take at call time: :func:`te_replay_kwargs`.

Contract, as for :class:`~graphslot.arena.VariantGraphs`: the variants are mutually
exclusive at replay time. Run one variant's graphed callables (forward and backward) and
consume their outputs before another variant's run, on one stream. To close the arena,
drop the graphed callables first (their graphs hold the pool).

The pool handle and the routing come from the region-graph interface
(:class:`~graphslot.regions.RegionGraph`: ``pool_handle`` and ``lend()``). On cuda the
handle is the variant's ``torch.cuda.MemPool`` id (graphslot's allocator over the region);
TE's captures are routed into the region while TE runs, and the backend warms up torch's
default capture stream first so per-stream library workspaces stay out of the shared pages.
On other backends the handle is the variant's pool graph itself, which a
``make_graphed_callables``-compatible function passes to
``backend.new_graph(share_pool_with=...)``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable

from graphslot.arena import VariantGraphs
from graphslot.backend import Backend, DeviceGraph, no_gc
from graphslot.errors import BackendUnavailableError, StateError, UsageError
from graphslot.planner import Plan, PlanError, branch_table
from graphslot.regions import RegionGraph

if TYPE_CHECKING:
    from graphslot.offload import OffloadEngine

__all__ = ["TEFeatures", "TEFeatureError", "MIN_TE_VERSION", "check_te", "load_te",
           "pool_handle", "make_graphed_callables", "te_replay_kwargs"]

#: The TransformerEngine release that introduced each feature graphslot uses.
MIN_TE_VERSION: dict[str, str] = {
    "pool": "1.12",
    "warmup_hooks": "2.14",
    "replay_stream": "2.14",
    "capture_time_hooks": "2.19",
}

#: What each feature is called in TE's interface (for error messages).
_FEATURE_NAMES: dict[str, str] = {
    "pool": "the pool= argument",
    "warmup_hooks": "the pre_warmup_hook=/post_warmup_hook= arguments",
    "replay_stream": "the cuda_graph_stream/cuda_graph_event call keywords of graphed callables",
    "capture_time_hooks": "the capture_time_hooks= argument",
}

#: TE keyword arguments that belong to a feature.
_PARAM_FEATURE: dict[str, str] = {
    "pool": "pool",
    "pre_warmup_hook": "warmup_hooks",
    "post_warmup_hook": "warmup_hooks",
    "capture_time_hooks": "capture_time_hooks",
}


class TEFeatureError(UsageError):
    """The ``make_graphed_callables`` in use lacks a TransformerEngine feature asked for."""


# --------------------------------------------------------------------------- features


@dataclass(frozen=True)
class TEFeatures:
    r"""What a ``make_graphed_callables`` function supports, read from its signature.

    Attributes:
        version: the installed TransformerEngine's version, or ``None`` if it is not
            installed. Features come from the function's signature, not from this.
        pool: takes ``pool=`` (TE >= 1.12).
        warmup_hooks: takes ``pre_warmup_hook=`` and ``post_warmup_hook=`` (TE >= 2.14).
        capture_time_hooks: takes ``capture_time_hooks=`` (TE 2.19).
        replay_stream: its graphed callables take ``cuda_graph_stream=`` and
            ``cuda_graph_event=`` when called (TE >= 2.14). No signature shows this; it is
            inferred from the warm-up hooks, which came in the same release.
        parameters: the keyword parameters the function names.
        var_keyword: it takes ``**kwargs`` (then every keyword counts as accepted).
        source: the function's module and qualified name, for messages.
    """

    version: str | None
    pool: bool
    warmup_hooks: bool
    capture_time_hooks: bool
    replay_stream: bool
    parameters: frozenset[str]
    var_keyword: bool
    source: str

    def accepts(self, keyword: str) -> bool:
        """True when ``keyword`` can be passed to the function."""
        return self.var_keyword or keyword in self.parameters

    def require(self, *features: str) -> None:
        r"""Raise :class:`TEFeatureError` unless every named feature is supported.

        Args:
            features: names among ``pool``, ``warmup_hooks``, ``capture_time_hooks`` and
                ``replay_stream``.
        """
        for f in features:
            if f not in MIN_TE_VERSION:
                raise UsageError(f"unknown TransformerEngine feature {f!r}; known: "
                                 f"{', '.join(MIN_TE_VERSION)}")
            if not getattr(self, f):
                raise TEFeatureError(self._missing(f))

    def _missing(self, feature: str) -> str:
        installed = f"; installed TransformerEngine: {self.version}" if self.version else ""
        return (f"{_FEATURE_NAMES[feature]} ({feature}) needs TransformerEngine >= "
                f"{MIN_TE_VERSION[feature]}, and {self.source} does not support it{installed}")

    def check_keywords(self, keywords: Any) -> None:
        """Raise :class:`TEFeatureError` for a keyword the function does not take, naming
        the TE version that introduced it when it is one of graphslot's features."""
        for k in keywords:
            if self.accepts(k):
                continue
            f = _PARAM_FEATURE.get(k)
            if f is not None:
                raise TEFeatureError(self._missing(f))
            raise TEFeatureError(f"{self.source} takes no argument {k!r} (it takes: "
                                 f"{', '.join(sorted(self.parameters)) or 'nothing'})")


def _te_version() -> str | None:
    mod = sys.modules.get("transformer_engine")
    v = getattr(mod, "__version__", None)
    if v:
        return str(v)
    for dist in ("transformer_engine", "transformer-engine"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def load_te() -> Callable[..., Any]:
    r"""``transformer_engine.pytorch.make_graphed_callables``, imported now.

    Raises:
        BackendUnavailableError: TransformerEngine (or its PyTorch extension) cannot be
            imported here; the message carries the import error.
    """
    try:
        mod = importlib.import_module("transformer_engine.pytorch")
        fn = mod.make_graphed_callables
    except Exception as e:  # ImportError, or OSError/RuntimeError from its extension
        raise BackendUnavailableError(
            "TransformerEngine is not importable here: import transformer_engine.pytorch "
            f"failed ({type(e).__name__}: {e}). Install TransformerEngine with its PyTorch "
            "extension, or pass te_make_graphed_callables=<a function with the signature of "
            "transformer_engine.pytorch.make_graphed_callables>") from e
    return fn  # type: ignore[no-any-return]


def check_te(fn: Callable[..., Any] | None = None, *, require: tuple[str, ...] = ()) -> TEFeatures:
    r"""Read what a ``make_graphed_callables`` function supports from its signature.

    Args:
        fn: the function (default: TransformerEngine's, imported now).
        require: features that must be present (see :meth:`TEFeatures.require`).

    Returns:
        :class:`TEFeatures`.

    Raises:
        BackendUnavailableError: ``fn`` is ``None`` and TransformerEngine is not importable.
        TEFeatureError: a feature in ``require`` is missing; the message names it and the
            TransformerEngine version that introduced it.
    """
    if fn is None:
        fn = load_te()
    if not callable(fn):
        raise UsageError(f"te_make_graphed_callables must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)  # follows functools.wraps' __wrapped__
    except (TypeError, ValueError) as e:
        raise UsageError(f"cannot read the signature of {fn!r}: {e}") from e
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = frozenset(n for n, p in sig.parameters.items() if p.kind in kinds)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())

    def has(*ps: str) -> bool:
        return var_kw or all(p in names for p in ps)

    hooks = has("pre_warmup_hook", "post_warmup_hook")
    feats = TEFeatures(
        version=_te_version(),
        pool=has("pool"),
        warmup_hooks=hooks,
        capture_time_hooks=has("capture_time_hooks"),
        replay_stream=hooks,
        parameters=names,
        var_keyword=var_kw,
        source=f"{getattr(fn, '__module__', None) or '?'}."
               f"{getattr(fn, '__qualname__', None) or type(fn).__name__}",
    )
    feats.require(*require)
    return feats


# --------------------------------------------------------------------------- pools


def pool_handle(graph: DeviceGraph) -> Any:
    r"""The pool handle to give TE for captures into ``graph``'s pool.

    Args:
        graph: a graph whose pool TE should capture into.

    Returns:
        For a :class:`~graphslot.regions.RegionGraph`, its ``pool_handle``; for another
        graph, ``graph.pool`` where the backend has one (cuda: the ``MemPool`` id that
        ``torch.cuda.graph(pool=...)`` takes), else the graph itself, which a
        ``make_graphed_callables``-compatible function passes to
        ``backend.new_graph(share_pool_with=...)``.
    """
    if isinstance(graph, RegionGraph):
        return graph.pool_handle
    pool = getattr(graph, "pool", None)
    return graph if pool is None else pool


class _Hooks:
    """graphslot's side of TE's warm-up hooks, composed with the caller's."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._gc = contextlib.ExitStack()
        self._gc_off = False

    def _not_capturing(self, what: str) -> None:
        if self.backend.is_capturing():
            raise StateError(f"{what} ran while a graph is being captured; TransformerEngine "
                             "runs it outside capture, and graphslot's driver calls are refused "
                             "during capture")

    def pre_warmup(self) -> None:
        self._not_capturing("pre_warmup_hook")
        # TE 2.14-2.18 run the hooks around each callable's warm-up: let warm-up garbage go.
        self._gc.close()
        self._gc_off = False

    def post_warmup(self) -> None:
        self._not_capturing("post_warmup_hook")
        if not self._gc_off:
            self._gc.enter_context(no_gc())  # collect the warm-up's garbage, then pause
            self._gc_off = True

    def compose(self, ours: Callable[[], None],
                theirs: Callable[[], Any] | None) -> Callable[[], None]:
        def hook() -> None:
            ours()
            if theirs is not None:
                theirs()

        hook.__qualname__ = f"graphslot.{ours.__name__}"
        return hook

    def close(self) -> None:
        self._gc.close()
        self._gc_off = False


def _check_plan(plan: Plan, variant: Hashable) -> None:
    if not isinstance(plan, Plan):
        raise UsageError(f"plan must be a graphslot.planner.Plan, got {type(plan).__name__}")
    branches = branch_table(plan.tensors)
    if not branches:
        raise PlanError(f"variant {variant!r}: the plan has no branches, so it plans no mutually "
                        "exclusive variants to check it against")
    if variant not in branches:
        raise PlanError(f"variant {variant!r} is not a branch of the plan (its branches: "
                        f"{', '.join(map(repr, branches))})")


def make_graphed_callables(
    modules: Any,
    sample_args: Any,
    *,
    variants: VariantGraphs | None = None,
    variant: Hashable | None = None,
    part: Hashable = "te",
    plan: Plan | None = None,
    pool: Any = None,
    backend: Backend | None = None,
    pre_warmup_hook: Callable[[], Any] | None = None,
    post_warmup_hook: Callable[[], Any] | None = None,
    te_make_graphed_callables: Callable[..., Any] | None = None,
    **te_kwargs: Any,
) -> Any:
    r"""TransformerEngine's ``make_graphed_callables``, with graphs in a graphslot pool.

    Calls ``te_make_graphed_callables(modules, sample_args, **te_kwargs)`` and returns what
    it returns, adding ``pool=`` and composed warm-up hooks (see the module docstring).

    Args:
        modules: passed to TE as is (a module or a tuple of modules).
        sample_args: passed to TE as is.
        variants: a :class:`~graphslot.arena.VariantGraphs` whose variant ``variant``'s pool
            TE captures into (graph ``part`` of that variant). Pass both or neither.
        variant: the variant's name in ``variants``.
        part: the graph name under which the capture is registered in the variant
            (another TE call for the same variant needs another part).
        plan: a :class:`~graphslot.planner.Plan` whose branches are the mutually exclusive
            variants; ``variant`` must be one of them. (A plan places tensors with known
            lifetimes, not a graph's private pool, so it does not size the pool.)
        pool: a pool handle passed through to TE, without ``variants``.
        backend: the graphslot backend (default: ``variants.backend``, else
            :func:`graphslot.get_backend`).
        pre_warmup_hook, post_warmup_hook: the caller's hooks, run after graphslot's
            (TE >= 2.14).
        te_make_graphed_callables: the function to call (default: TransformerEngine's,
            imported now); any function with TE's keywords works.
        \*\*te_kwargs: every other TE argument (``_order``, ``sample_kwargs``,
            ``capture_time_hooks``, ``num_warmup_iters``, ...), passed through untouched.

    Raises:
        BackendUnavailableError: no function was given and TransformerEngine is not
            importable.
        TEFeatureError: a feature asked for (``pool`` via ``variants``/``pool``, the hooks,
            any keyword in ``te_kwargs``) is not supported; names it and the TE version.
        PoolFullError: the variant's pool does not fit the arena.
        PlanError: ``variant`` is not a branch of ``plan``.
    """
    fn = load_te() if te_make_graphed_callables is None else te_make_graphed_callables
    feats = check_te(fn)
    feats.check_keywords(te_kwargs)
    if (variants is None) != (variant is None):
        raise UsageError("pass variants= and variant= together (the VariantGraphs and the "
                         "name of the variant TE captures)")
    if variants is not None:
        if not isinstance(variants, VariantGraphs):
            raise UsageError(f"variants must be a graphslot.arena.VariantGraphs, got "
                             f"{type(variants).__name__}")
        if pool is not None:
            raise UsageError("pass pool= or variants=, not both: with variants the pool is "
                             "the variant's")
        if backend is not None and backend is not variants.backend:
            raise UsageError(f"backend {backend!r} is not the backend of variants "
                             f"({variants.backend!r})")
        backend = variants.backend
    if plan is not None:
        if variant is None:
            raise UsageError("plan= checks the variant TE captures; pass variants= and variant=")
        _check_plan(plan, variant)
    if variants is not None or pool is not None:
        feats.require("pool")
    if pre_warmup_hook is not None or post_warmup_hook is not None:
        feats.require("warmup_hooks")
    if backend is None:
        from graphslot.selection import get_backend

        backend = get_backend()

    kwargs = dict(te_kwargs)
    if variants is None:
        if pool is not None:
            kwargs["pool"] = pool
        return _call(fn, feats, backend, None, modules, sample_args, kwargs,
                     pre_warmup_hook, post_warmup_hook)
    with variants.lend_pool(variant, part) as graph:
        kwargs["pool"] = pool_handle(graph)
        return _call(fn, feats, backend, graph, modules, sample_args, kwargs,
                     pre_warmup_hook, post_warmup_hook)


def _call(fn: Callable[..., Any], feats: TEFeatures, backend: Backend, graph: DeviceGraph | None,
          modules: Any, sample_args: Any, kwargs: dict[str, Any],
          user_pre: Callable[[], Any] | None, user_post: Callable[[], Any] | None) -> Any:
    hooks = _Hooks(backend)
    try:
        with contextlib.ExitStack() as stack:
            if isinstance(graph, RegionGraph):
                # A region graph routes allocations into its region only around its own
                # capture; TE captures its own graphs into the same pool, so the region
                # is routed for the whole TE call (lend(): on cuda, torch's default
                # capture stream is warmed up first, outside the region).
                stack.enter_context(graph.lend())
            if feats.warmup_hooks:
                kwargs["pre_warmup_hook"] = hooks.compose(hooks.pre_warmup, user_pre)
                kwargs["post_warmup_hook"] = hooks.compose(hooks.post_warmup, user_post)
            else:  # no hooks in this TE: prepare once, for warm-up and captures alike
                hooks.pre_warmup()
                hooks.post_warmup()
            return fn(modules, sample_args, **kwargs)
    finally:
        hooks.close()


# --------------------------------------------------------------------------- replay


def te_replay_kwargs(source: OffloadEngine | Backend, stream: Any = None, event: Any = None, *,
                     te_make_graphed_callables: Callable[..., Any] | None = None) -> dict[str, Any]:
    r"""Call keywords that order TE's graph replay with graphslot's copy streams.

    TE >= 2.14 graphed callables take ``cuda_graph_stream`` and ``cuda_graph_event``: the
    graph stream first waits for the current stream, the graph replays on it, and the
    current stream then waits for the whole graph stream (or, with an event, only for that
    event). graphslot's offload fences live on the current stream: ``wait_restored`` makes
    it wait for a restore before the backward, and ``after_forward`` records the
    forward-done event that the device-to-host copy waits on. So the graph must not replay
    on one of the engine's copy streams (compute would queue behind copies), and with an
    offloading engine there must be no event, or the copy could start before the graph's
    last writes. Pass the result to each graphed call: ``layer(x, **kw)``.

    Args:
        source: an :class:`~graphslot.offload.OffloadEngine` (its copy streams and mode
            are checked) or a :class:`~graphslot.backend.Backend`.
        stream: the stream TE replays on (default: the current stream when called).
        event: an event recorded inside the graph for the current stream to wait on
            instead of the whole graph; refused with an offloading engine.
        te_make_graphed_callables: the function whose graphed callables get the keywords
            (default: TransformerEngine's).

    Returns:
        ``{"cuda_graph_stream": stream, "cuda_graph_event": event}``.

    Raises:
        TEFeatureError: the graphed callables do not take these keywords (TE < 2.14).
        UsageError: ``stream`` is a copy stream of the engine, or an event was given with
            an offloading engine.
    """
    from graphslot.offload import OffloadEngine

    check_te(te_make_graphed_callables, require=("replay_stream",))
    engine = source if isinstance(source, OffloadEngine) else None
    backend = engine.backend if engine is not None else source
    if not isinstance(backend, Backend):
        raise UsageError(f"source must be an OffloadEngine or a Backend, got {type(source).__name__}")
    if stream is None:
        stream = backend.current_stream()
    if engine is not None:
        for name in ("d2h_stream", "h2d_stream"):
            copy = getattr(engine, name)
            if stream is copy or stream == copy:
                raise UsageError(f"cuda_graph_stream is the offload engine's {name}: graph compute "
                                 "would queue behind activation copies; replay on a compute stream")
        if event is not None and engine.offloads:
            raise UsageError("cuda_graph_event with an offloading engine: the current stream would "
                             "wait only for the event, so the forward-done fence recorded after the "
                             "call would not cover the graph's last writes and the offload copy "
                             "could read them early; leave the event out")
    return {"cuda_graph_stream": stream, "cuda_graph_event": event}
