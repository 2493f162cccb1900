"""One line per configuration of a `graphslot bench --json` report: step, peak, the plan
(K keep, O offload, R recompute), the model's peak beside the build's, and vs_base.

    python benchmarks/bench_summary.py REPORT   (a JSON file, or a log whose last thing is one)
"""

from __future__ import annotations

import json
import sys

from graphslot.budget import plan_letters

GiB = 1 << 30


def load(path: str) -> dict:
    text = open(path).read()
    start = 0 if text.startswith("{\n") else text.rfind("\n{\n") + 1
    return json.JSONDecoder().raw_decode(text, start)[0]


def main(path: str) -> None:
    for name, c in load(path)["configs"].items():
        if "reason" in c:
            print(f"{name}: {c['reason']}")
            continue
        line = f"{name}: {c['step_ms']:.1f} ms, {c['peak_device_bytes'] / GiB:.3f} GiB"
        p = c.get("plan")
        if p:
            letters = plan_letters(p["choices"], p.get("recompute_ops") or ())
            model = p.get("model_peak_bytes")
            line += (f"; {letters} {p['mode']}, built {p['predicted_peak_bytes'] / GiB:.3f} GiB"
                     + (f", model {model / GiB:.3f} GiB" if model else "")
                     + f", predicted {p['predicted_step_ms']:.1f} ms")
        if c.get("vs_base"):
            v = c["vs_base"]
            line += f"; vs {v['config']}: step/microbatch {v['step_per_microbatch']:.3f}, peak {v.get('peak', 0):.4f}"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1])
