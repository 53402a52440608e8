import os,sys,json,collections
def snap(pid):
    out=collections.Counter()
    for tid in os.listdir(f'/proc/{pid}/task'):
        try:
            name=open(f'/proc/{pid}/task/{tid}/comm').read().strip()
            f=open(f'/proc/{pid}/task/{tid}/stat').read().rsplit(')',1)[1].split()
        except OSError: continue
        t=(int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK')
        key = 'main' if tid==str(pid) else name
        out[key]+=t
    return out
if __name__ != '__main__':
    pass
elif sys.argv[1]=='snap':
    json.dump(snap(int(sys.argv[2])),open(sys.argv[3],'w'))
else:
    a=json.load(open(sys.argv[2])); b=snap(int(sys.argv[3]))
    d={k:round(b[k]-a.get(k,0),2) for k in b if b[k]-a.get(k,0)>0.005}
    json.dump(d, open('/tmp/sg/thrd.json','w')); print(' threads cpu s:', dict(sorted(d.items(), key=lambda kv:-kv[1])))
