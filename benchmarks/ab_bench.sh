#!/usr/bin/env bash
# The bench of two revisions side by side on one device, in one call:
#
#   git archive REV | (mkdir -p .ab/old && tar -x -C .ab/old)   # here, before the call
#   benchmarks/ab_bench.sh [ROUNDS] [PRESET] [CONFIGS]          # there, carrying .ab
#
# The other revision (.ab/old, ignored by git: carry it) is installed into a folder of its
# own and put first on PYTHONPATH for its runs; this tree is installed as usual. The two
# run in turns (old, new, old, new, ...), each a `graphslot bench --isolate` of the same
# configurations, so drift of the device over the call falls on both alike. Each run's
# JSON lands in $OUT/ab/{old,new}_K.json; the table at the end gives each configuration's
# median step and peak per revision and their ratios, new over old.
set -uo pipefail
rounds=${1:-2}
preset=${2:-default}
configs=${3:-eager,graph,graph_resident,graph_remap}
out=${OUT:-/tmp/graphslot-ab}
mkdir -p "$out/ab"
cd "$(dirname "$0")/.."
[[ -d .ab/old ]] || { echo "no .ab/old: git archive REV | tar -x -C .ab/old first" >&2; exit 2; }

python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/ab/install.log" 2>&1 &&
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/graphslot-old .ab/old \
    >> "$out/ab/install.log" 2>&1 || { cat "$out/ab/install.log"; exit 1; }
export GRAPHSLOT_BACKEND=cuda PYTHONUNBUFFERED=1
for rev in old new; do  # which package each run imports
  if [[ $rev == old ]]; then pp=/tmp/graphslot-old; else pp=; fi
  echo "$rev: $(PYTHONPATH=$pp python3 -c 'import graphslot, os; print(os.path.dirname(graphslot.__file__))')"
done

for k in $(seq 1 "$rounds"); do
  for rev in old new; do
    if [[ $rev == old ]]; then pp=/tmp/graphslot-old; else pp=; fi
    echo "== round $k $rev"
    PYTHONPATH=$pp python3 -m graphslot.cli bench --preset "$preset" --configs "$configs" \
      --isolate --json --quiet > "$out/ab/${rev}_$k.json" 2> "$out/ab/${rev}_$k.err" ||
      tail -n 5 "$out/ab/${rev}_$k.err"
  done
done

python3 - "$out/ab" <<'PY'
import json, pathlib, statistics, sys
d = pathlib.Path(sys.argv[1])
runs = {"old": [], "new": []}
for p in sorted(d.glob("*_*.json")):
    try:
        runs[p.stem.split("_")[0]].append(json.loads(p.read_text()))  # (--json writes one document)
    except (ValueError, KeyError):
        print(f"{p.name}: no JSON")
names = sorted({n for r in runs["new"] for n in r.get("configs", {})})
def med(rev, name, key):
    vals = [r["configs"][name].get(key) for r in runs[rev] if name in r.get("configs", {})]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None
print(f"{'config':28} {'old ms':>8} {'new ms':>8} {'new/old':>8} {'old GiB':>8} {'new GiB':>8} {'new/old':>8}")
for n in names:
    so, sn = med("old", n, "step_ms"), med("new", n, "step_ms")
    po, pn = med("old", n, "peak_device_bytes"), med("new", n, "peak_device_bytes")
    r = lambda a, b: f"{b / a:8.3f}" if a and b else f"{'-':>8}"
    g = lambda v: f"{v / 2**30:8.3f}" if v else f"{'-':>8}"
    print(f"{n:28} {so or 0:8.1f} {sn or 0:8.1f} {r(so, sn)} {g(po)} {g(pn)} {r(po, pn)}")
PY
