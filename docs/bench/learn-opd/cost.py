"""Teacher scoring cost per step from a run's timeline: generation window, teacher busy time
(union of its spans), the tail the teacher adds after the last generation span, and the share."""
import json, sys, glob, statistics
from collections import defaultdict
def union(iv):
    tot, cur = 0.0, None
    for a, b in sorted(iv):
        if cur is None or a > cur[1]:
            if cur: tot += cur[1] - cur[0]
            cur = [a, b]
        else: cur[1] = max(cur[1], b)
    return tot + (cur[1] - cur[0] if cur else 0.0)
for run in sys.argv[1:]:
    steps = defaultdict(list); hdr = {}
    for l in open(f"{run}/timeline.jsonl"):
        d = json.loads(l)
        if d.get("kind") == "step": hdr[d["step"]] = d
        else: steps[d["step"]].append(d)
    metrics = {m["step"]: m for m in map(json.loads, open(f"{run}/metrics.jsonl"))}
    rows = []
    for k in sorted(steps):
        gen = [s for s in steps[k] if not str(s["worker"]).startswith("frozen:")]
        fr = [s for s in steps[k] if str(s["worker"]).startswith("frozen:")]
        if not gen: continue
        g1 = max(s["end"] for s in gen)
        h = hdr.get(k)
        window = (h["end"] - h["start"]) if h else None
        tail = max(0.0, max((s["end"] for s in fr), default=g1) - g1)
        m = metrics.get(k, {})
        rows.append((k, window, union([(s["start"], s["end"]) for s in fr]), tail,
                     m.get("frozen/teacher/seconds"), m.get("rollout/seconds"), m.get("step/seconds"), len(fr)))
    print(run)
    for r in rows: print("  step %d window %.2f teacher-busy %.2f tail %.2f summed %.1f rollout %.2f step %.2f reqs %d" % tuple(x if x is not None else float('nan') for x in r))
    if rows:
        print("  mean: rollout %.2f s, teacher busy %.2f s, tail after generation %.2f s (%.0f%% of rollout), step %.2f s" % (
            statistics.mean(r[5] for r in rows), statistics.mean(r[2] for r in rows), statistics.mean(r[3] for r in rows),
            100 * statistics.mean(r[3] for r in rows) / statistics.mean(r[5] for r in rows), statistics.mean(r[6] for r in rows)))
