#!/usr/bin/env bash
# The cuda suite and the bench on a GPU machine, in parts that each fit one device call
# (a call may last ten minutes; each part takes about six on an H200):
#
#   benchmarks/gpu_check.sh PART
#
#   files F...  the test modules named, each in a process of its own, all at once (the
#           areas a change touched; each limited to SUITE_LIMIT seconds, default 300)
#   a       test_offload, test_graphed_grads, test_arena, test_conformance, test_cpu_strict,
#           test_cli_args, test_bench
#   b       test_cuda_capture, test_reliability, test_adapter_megatron (needs .wheels/)
#   c       every other test module (test_stateful with GRAPHSLOT_STATEFUL_EXAMPLES,
#           default 25 per mode here)
#   abc     a, b and c at once, each in a process of its own on the one device (the
#           memory figures those tests check are per process), without -x; then the
#           Megatron tests alone (they check device-wide memory)
#   suite   the cuda suite: test_offload alone (beside others it slows past seven
#           minutes; alone it takes two), then six processes at once (the rest of a, b,
#           and c in four groups of about equal size), each limited to SUITE_LIMIT seconds
#           (default 500), then the Megatron tests alone; $OUT gets summary.txt and the
#           logs in suite_logs.tar.gz (a device call brings back eight files at most).
#           About eight minutes on an H200
#   te      test_adapter_te against real TransformerEngine (.te/base/install.sh installs
#           the TE wheels you brought; see docs/gpu.md)
#   megatron_te  with TE importable (carry .te/base and .wheels): the four Megatron training
#           tests (local spec, TE spec bf16, fp8 per served recipe), their runs' JSON in
#           $OUT/megatron; about six minutes
#   weakrefs with TE importable: the local-spec GPT four ways, 20 steps each (local graphs
#           alone, watched with --report-weakrefs, with Megatron's make_weakref as the
#           identity, and graphslot remap), and whose losses equal whose
#   bench   graphslot bench --isolate, default shape, JSON (each configuration in a process
#           of its own, so none carries what an earlier one left in the process)
#   llama   graphslot bench --preset llama --budgets sweep --isolate beside every peer, JSON
#   launch  graphslot bench --preset launch --isolate --rounds 3, JSON (that preset's step
#           times move by a third between runs), plus a device timeline of remap
#   peers PRESET  the peers and graph's own configurations alone, JSON (with `sweep`, a
#           preset's sweep in two calls: one run of every configuration of the default
#           preset's `--budgets sweep` ran past ten minutes)
#   sweep PRESET  the budget sweep with only checkpoint and graph beside it (SWEEP_CONFIGS
#           names others: eager,checkpoint,graph, say), JSON; OPTIMIZER=adamw steps AdamW
#           (the default preset's, with eager and checkpoint, ran past five minutes)
#   budgets PRESET SIZES  the budgets named (e.g. 6.84GiB,7.03GiB) beside SWEEP_CONFIGS
#           (default checkpoint,graph), JSON; OPTIMIZER=adamw steps AdamW instead of SGD
#   probe PRESET SIZES  benchmarks/budget_probe.py at those budgets (and every layer kept,
#           every layer recomputed): each plan's predicted peak and step beside its own
#   held [PRESET]  benchmarks/held_by_stream.py: what a build keeping everything and one with
#           memory_budget="auto" hold after it, by the allocator's stream (default: launch)
#   pools [PRESET]  benchmarks/pool_split.py with every layer recomputed (remap; POOL_MODES=
#           remap,off for both): the graphs' shared pool as built against a pool per
#           backward graph (POOL_VARIANTS names others: maxsplit, fixed; default preset: llama)
#   parts [PRESET]  benchmarks/recompute_parts.py: one layer's backward working memory and
#           graph pool when its attention and MLP are recomputed one at a time, against
#           whole-layer recompute (default preset: llama; about a minute)
#   pages [PRESET] [SIZES]  share_pool_pages beside the plain pool: graph, every layer recomputed
#           by parts, and each budget in SIZES (e.g. 8.59GiB,10.39GiB), each with and
#           without @pages, beside eager and checkpoint (default preset: llama), JSON
#   memory PLANS...  benchmarks/build_memory.py on the llama preset (PLANS: keep, recompute,
#           parts, budget:GIB): what a build holds, by allocating frame, and the graphs'
#           pool's segments against the most of it ever live at once (under a minute each)
#   grads [PRESET]  eager and the three modes with zero_grad(), each beside its variant
#           with .grad kept (zero_grad(set_to_none=False)) over four accumulated
#           microbatches, in one run: what a kept gradient costs (default preset: default,
#           which ran past four minutes; a process of one configuration takes 30-60 s)
#
# Logs and results go to $OUT (the device tool brings that folder back, also when a part
# runs out of time), so nothing is piped through a filter that a timeout would cut off.
# A bench's log says, a line each, which configuration it started and when, then ends with
# its JSON.
set -uo pipefail
part=${1:?"which part: abc, suite, files, a, b, c, te, megatron_te, weakrefs, bench, launch, llama, peers, sweep, budgets, probe, held, pools, parts, pages, memory or grads"}
out=${OUT:-/tmp/graphslot-gpu-check}
mkdir -p "$out"
cd "$(dirname "$0")/.."

python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || {
  cat "$out/install.log"; exit 1; }
if compgen -G ".wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps .wheels/*.whl >> "$out/install.log" 2>&1
fi
export GRAPHSLOT_BACKEND=cuda PYTHONUNBUFFERED=1

a=(tests/test_offload.py tests/test_graphed_grads.py tests/test_arena.py tests/test_conformance.py
   tests/test_cpu_strict.py tests/test_cli_args.py tests/test_bench.py)
b_device=(tests/test_cuda_capture.py tests/test_reliability.py)  # (abc runs these beside a and c)
b=("${b_device[@]}" tests/test_adapter_megatron.py)
named=" ${a[*]} ${b[*]} tests/test_adapter_te.py "
c=()
for f in tests/test_*.py; do
  [[ $named == *" $f "* ]] || c+=("$f")
done

run() {  # run NAME COMMAND...: the command's output lands in $OUT/NAME.log as it comes
  local name=$1; shift
  echo "== $name: $*" | tee "$out/$name.log"
  "$@" >> "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc"
  return $rc
}

case $part in
  abc)  # a, b and c at once on the one device (about as long as the longest of them); the
        # Megatron tests after, alone: they check device-wide (driver-level) memory
    run a python3 -m pytest -q -rs "${a[@]}" > "$out/a.tail" 2>&1 & pa=$!
    run b python3 -m pytest -q -rs "${b_device[@]}" > "$out/b.tail" 2>&1 & pb=$!
    GRAPHSLOT_STATEFUL_EXAMPLES=${GRAPHSLOT_STATEFUL_EXAMPLES:-25} \
      run c python3 -m pytest -q -rs "${c[@]}" > "$out/c.tail" 2>&1 & pc=$!
    rc=0
    for p in $pa $pb $pc; do wait "$p" || rc=1; done
    run megatron python3 -m pytest -q -rs tests/test_adapter_megatron.py > "$out/m.tail" 2>&1 || rc=1
    cat "$out/a.tail" "$out/b.tail" "$out/c.tail" "$out/m.tail"
    exit $rc ;;
  suite)  # test_offload alone, six groups at once, then Megatron alone; logs in one archive
    a1=(tests/test_offload.py); a2=("${a[@]:1}")
    mapfile -t by_size < <(for f in "${c[@]}"; do echo "$(stat -c %s "$f") $f"; done | sort -rn | awk '{print $2}')
    groups=("" "" "" ""); sizes=(0 0 0 0)
    for f in "${by_size[@]}"; do  # (the largest file first, to the least filled group)
      m=0; for i in 1 2 3; do (( sizes[i] < sizes[m] )) && m=$i; done
      groups[m]+=" $f"; sizes[m]=$(( sizes[m] + $(stat -c %s "$f") ))
    done
    mkdir -p "$out/suite"
    limit=${SUITE_LIMIT:-500}
    GRAPHSLOT_STATEFUL_EXAMPLES=${GRAPHSLOT_STATEFUL_EXAMPLES:-25}; export GRAPHSLOT_STATEFUL_EXAMPLES
    rc=0
    # test_offload first, alone: beside six others it ran past 420 s, alone in under 120
    timeout "$limit" python3 -m pytest -q -rs "${a1[@]}" > "$out/suite/a1.log" 2>&1 || rc=1
    pids=()
    timeout "$limit" python3 -m pytest -q -rs "${a2[@]}" > "$out/suite/a2.log" 2>&1 & pids+=($!)
    timeout "$limit" python3 -m pytest -q -rs "${b_device[@]}" > "$out/suite/b.log" 2>&1 & pids+=($!)
    for i in 0 1 2 3; do
      # shellcheck disable=SC2086
      timeout "$limit" python3 -m pytest -q -rs ${groups[i]} > "$out/suite/c$i.log" 2>&1 & pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    timeout "$limit" python3 -m pytest -q -rs tests/test_adapter_megatron.py > "$out/suite/m.log" 2>&1 || rc=1
    for f in a1 a2 b c0 c1 c2 c3 m; do
      echo "=== $f"; tail -n 1 "$out/suite/$f.log"; grep -E "^(FAILED|ERROR) " "$out/suite/$f.log" | head -n 20
    done > "$out/summary.txt"
    tar -czf "$out/suite_logs.tar.gz" -C "$out" suite && rm -rf "$out/suite"
    cat "$out/summary.txt"
    exit $rc ;;
  files)  # the test modules named, each in a process of its own, all at once, each
          # limited to SUITE_LIMIT seconds (default 300): the areas a change touched
    shift
    limit=${SUITE_LIMIT:-300}
    pids=(); names=()
    for f in "$@"; do
      n=$(basename "$f" .py); names+=("$n")
      timeout "$limit" python3 -m pytest -q -rs "$f" > "$out/$n.log" 2>&1 & pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for n in "${names[@]}"; do
      echo "=== $n"; tail -n 1 "$out/$n.log"; grep -E "^(FAILED|ERROR) " "$out/$n.log" | head -n 20
    done | tee "$out/summary.txt"
    exit $rc ;;
  a) run a python3 -m pytest -x -q -rs "${a[@]}" ;;
  b) run b python3 -m pytest -x -q -rs "${b[@]}" ;;
  c) GRAPHSLOT_STATEFUL_EXAMPLES=${GRAPHSLOT_STATEFUL_EXAMPLES:-25} run c python3 -m pytest -x -q -rs "${c[@]}" ;;
  te)
    # shellcheck disable=SC1091
    source .te/base/install.sh || exit 1
    run te python3 -m pytest -x -q -rs tests/test_adapter_te.py ;;
  megatron_te)
    # shellcheck disable=SC1091
    source .te/base/install.sh || exit 1
    GRAPHSLOT_RESULTS_DIR="$out/megatron" run megatron_te python3 -m pytest -q -rs -s \
      tests/test_adapter_megatron.py -k "train" ;;
  weakrefs)
    # shellcheck disable=SC1091
    source .te/base/install.sh || exit 1
    mkdir -p "$out/weakrefs"
    for r in "graphs --mode graphs" "watched --mode graphs --report-weakrefs" \
             "kept --mode graphs --keep-graph-buffers" "remap --mode remap"; do
      set -- $r; name=$1; shift
      run "weakrefs_$name" python3 tests/megatron_worker.py --steps 20 "$@" --out "$out/weakrefs/$name.json"
    done
    python3 - "$out/weakrefs" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
ref = runs.get("kept")
for name, r in runs.items():
    same = ref is not None and r["losses"] == ref["losses"] and r["params_sha256"] == ref["params_sha256"]
    print(f"{name}: bitwise equal to kept: {same}; last loss {r['losses'][-1]!r}; {r.get('weakrefs', '')}")
PY
    ;;
  bench)
    run bench python3 -m graphslot.cli bench --isolate --json --plot "$out/bench_default.png" \
      --trace "$out/bench_default_trace.json" ;;
  launch)
    run launch python3 -m graphslot.cli bench --preset launch --isolate --rounds 3 --json \
      --plot "$out/bench_launch.png" &&
      run launch_remap python3 -m graphslot.cli bench --preset launch --configs graph_remap \
        --json --trace "$out/launch_remap_trace.json" ;;
  llama)  # the memory budget sweep beside every peer (about seven minutes; needs transformers)
    run llama python3 -m graphslot.cli bench --preset llama --budgets sweep --isolate --json \
      --steps 5 --warmup 2 \
      --configs eager,save_on_cpu,checkpoint,torch_graphed,torch_graphed_checkpoint,graph,graph_recompute,graph_recompute_parts,graph_auto \
      --plot "$out/llama.png" ;;
  peers)
    preset=${2:?"peers: which preset"}
    run "peers_$preset" python3 -m graphslot.cli bench --preset "$preset" --isolate --json \
      --steps 5 --warmup 2 \
      --configs eager,save_on_cpu,checkpoint,torch_graphed,torch_graphed_checkpoint,graph,graph_recompute,graph_recompute_parts,graph_auto ;;
  sweep)
    preset=${2:?"sweep: which preset"}
    run "sweep_$preset${OPTIMIZER:+_$OPTIMIZER}" python3 -m graphslot.cli bench --preset "$preset" \
      --budgets sweep --isolate --optimizer "${OPTIMIZER:-sgd}" --json --steps 5 --warmup 2 \
      --configs "${SWEEP_CONFIGS:-checkpoint,graph}" --plot "$out/sweep_$preset${OPTIMIZER:+_$OPTIMIZER}.png" ;;
  budgets)
    preset=${2:?"budgets: which preset"}; sizes=${3:?"budgets: which sizes, e.g. 6.84GiB,7.03GiB"}
    run "budgets_$preset${OPTIMIZER:+_$OPTIMIZER}" python3 -m graphslot.cli bench --preset "$preset" \
      --budgets "$sizes" --optimizer "${OPTIMIZER:-sgd}" \
      --isolate --json --steps 5 --warmup 2 --configs "${SWEEP_CONFIGS:-checkpoint,graph}" ;;
  probe)  # benchmarks/budget_probe.py at the budgets named, each plan in a process of its own
    preset=${2:?"probe: which preset"}; sizes=${3:?"probe: which sizes, e.g. 6.84GiB"}
    run "probe_$preset" python3 benchmarks/budget_probe.py --preset "$preset" --budgets "$sizes" ;;
  held)
    run "held_${2:-launch}" python3 benchmarks/held_by_stream.py --preset "${2:-launch}" ;;
  pools)  # every layer recomputed: the graphs' shared pool against a pool per backward graph
          # (benchmarks/pool_split.py; POOL_VARIANTS names others: maxsplit, fixed), remap
          # (POOL_MODES=remap,off for both)
    preset=${2:-llama}
    modes=${POOL_MODES:-remap}
    for m in ${modes//,/ }; do
      run "pools_${preset}_$m" python3 benchmarks/pool_split.py --preset "$preset" --mode "$m" \
        --variants "${POOL_VARIANTS:-shared,split}"
    done ;;
  parts)
    run "parts_${2:-llama}" python3 benchmarks/recompute_parts.py --preset "${2:-llama}" --json ;;
  pages)  # the graphs' pool on shared pages (@pages) beside the plain pool, JSON
    preset=${2:-llama}; configs="eager,checkpoint,graph,graph@pages,graph_recompute_parts,graph_recompute_parts@pages"
    for size in ${3//,/ }; do configs+=",budget:$size,budget:$size@pages"; done
    run "pages_$preset" python3 -m graphslot.cli bench --preset "$preset" --isolate --json \
      --steps 5 --warmup 2 --configs "$configs" ;;
  memory)
    shift
    if (($#)); then plans=("$@"); else plans=(recompute parts); fi
    run memory python3 benchmarks/build_memory.py "${plans[@]}" ;;
  grads)  # a kept .grad over four microbatches beside zero_grad(), per mode, in one run
    preset=${2:-default}
    configs=""
    for c in eager graph graph_resident graph_remap; do configs+="$c,$c@keep@acc4,"; done
    run "grads_$preset" python3 -m graphslot.cli bench --preset "$preset" --isolate --json \
      --steps 3 --warmup 1 --configs "${configs%,}" ;;
  *) echo "unknown part '$part': choose abc, suite, files, a, b, c, te, megatron_te, weakrefs, bench, launch, llama, peers, sweep, budgets, probe, held, pools, parts, pages, memory or grads" >&2; exit 2 ;;
esac
