import collections,sys
by_thread=collections.Counter(); by_fn=collections.Counter(); self_fn=collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rstrip().rsplit(' ',1); n=int(n)
    frames = stack.split(';')
    th=frames[0].split(': ')[-1][:20]
    by_thread[th]+=n
    self_fn[(th,frames[-1])]+=n
    seen=set()
    for f in frames[1:]:
        if f not in seen: by_fn[(th,f)]+=n; seen.add(f)
print(by_thread.most_common(6))
flt=sys.argv[2] if len(sys.argv)>2 else ''
print('--- inclusive')
for k,v in by_fn.most_common(400):
    if flt in k[0]: print(v,k)
print('--- self')
for k,v in self_fn.most_common(40): print(v,k)
