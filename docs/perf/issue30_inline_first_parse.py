import re,sys,statistics as st
def runs(path):
    out=[]; cur=None
    for line in open(path):
        if line.startswith('tensorverbs bench p2p'):
            cur={}; out.append(cur)
        m=re.match(r'\s+(4B|4KiB|64KiB|1MiB)\s+\d+\s+([\d.]+) \[[^\]]*\]\s+[\d.]+\s+\d+\s+\d+\s+([\d.]+) \[',line)
        if m and cur is not None:
            cur[m.group(1)]=(float(m.group(2)),float(m.group(3)))
    return [r for r in out if len(r)==4]
def q(v): 
    v=sorted(v); return f"{st.median(v):.3g} [{v[0]:.3g}-{v[-1]:.3g}]"
a=runs(sys.argv[1])[1:]  # drop warm-up
b=runs(sys.argv[2])[1:]
n=min(len(a),len(b)); a=a[:n]; b=b[:n]
print("runs",n)
print("4B p50 us:", q([r['4B'][0] for r in a]), "|", q([r['4B'][0] for r in b]), "| ratio a/b", q([x['4B'][0]/y['4B'][0] for x,y in zip(a,b)]))
for s in ['4KiB','64KiB','1MiB']:
    print(s,"GB/s:", q([r[s][1] for r in a]), "|", q([r[s][1] for r in b]), "| ratio a/b", q([x[s][1]/y[s][1] for x,y in zip(a,b)]))
