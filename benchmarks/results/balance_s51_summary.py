import sys, re, math, collections
def parse(path):
    out = {}
    for line in open(path):
        if not line.startswith('BALANCE'): continue
        f = line.split()
        key = (f[1], int(f[4]), int(f[5]))
        d = dict(default=float(f[6]), pick=f[7], cost=float(f[8]))
        opts = {}
        for tok, val in zip(f[9::2], f[10::2]):
            if val == '-': continue
            us, ctas, cost = val.split('/')
            opts[tok] = (float(us), int(ctas), float(cost))
        d['opts'] = opts
        out[key] = d
    return out
runs = [parse(p) for p in sys.argv[1:]]
keys = runs[0].keys()
gm = []; rows = []
for k in keys:
    ds = [r[k] for r in runs if k in r]
    dflt = sum(d['default'] for d in ds) / len(ds)
    opts = collections.defaultdict(list)
    for d in ds:
        for o, v in d['opts'].items(): opts[o].append(v[0])
    avg = {o: sum(v)/len(v) for o, v in opts.items() if len(v) == len(ds)}
    best = min(avg, key=avg.get)
    gm.append(math.log(avg[best] / dflt))
    rows.append((avg[best] / dflt, k, ds[0]['pick'], best, dflt, avg[best]))
rows.sort()
for r in rows[:40]: print(f"{r[0]:.3f} {r[1]} {r[2]} best {r[3]} {r[4]:.2f} -> {r[5]:.2f}")
print("cases", len(rows), "geomean best/default", math.exp(sum(gm)/len(gm)))
