"""Summarize a chrome trace of GPU work (torch.profiler): busy time, the gaps between
consecutive GPU events and what follows them, and time by kernel name."""

import collections
import json
import sys

with open(sys.argv[1]) as f:
    trace = json.load(f)
ev = [e for e in trace["traceEvents"]
      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
ev.sort(key=lambda e: e["ts"])
busy, end, gaps = 0.0, None, []
for e in ev:
    start, dur = e["ts"], e["dur"]
    if end is not None and start > end:
        gaps.append((start - end, e["name"][:70], e.get("cat")))
    busy += dur
    end = max(end or 0, start + dur)
span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) if ev else 0
total_gaps = sum(g for g, _, _ in gaps)
print(f"events {len(ev)} span_us {span:.0f} busy_us {busy:.0f} gaps_us {total_gaps:.0f} "
      f"n_gaps {len(gaps)}")
for lim in (2, 5, 20, 100):
    big = [g for g in gaps if g[0] > lim]
    print(f"gaps > {lim} us: {len(big)} total {sum(g for g, _, _ in big):.0f}")
gaps.sort(reverse=True)
for g, name, cat in gaps[:25]:
    print(f"{g:9.1f} before {cat} {name}")
by = collections.defaultdict(list)
for g, name, _ in gaps:
    by[name].append(g)
print("-- gap totals by the event after")
for name, gs in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:15]:
    print(f"{sum(gs):9.0f} us {len(gs):6d}x {name}")
count: collections.Counter[str] = collections.Counter()
time_by: collections.Counter[str] = collections.Counter()
for e in ev:
    count[e["name"][:70]] += 1
    time_by[e["name"][:70]] += e["dur"]
print("-- busy by name")
for name, dur in time_by.most_common(30):
    print(f"{dur:10.0f} us {count[name]:6d}x {name}")
