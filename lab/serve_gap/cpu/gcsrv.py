"""The server with GC timing: gc.callbacks time each collection; touching /tmp/sg/gc_req_<port> writes
/tmp/sg/gc_<port>.json (and resets). SG_GC_THRESHOLD="a,b,c" sets gc.set_threshold first."""
import gc, json, os, sys, threading, time, runpy, collections
port = sys.argv[sys.argv.index('--port') + 1]
thr = os.environ.get('SG_GC_THRESHOLD')
if thr:
    gc.set_threshold(*map(int, thr.split(',')))
stats = collections.defaultdict(lambda: [0, 0.0, 0.0]); t0 = {}
def cb(phase, info):
    if phase == "start": t0['t'] = time.perf_counter()
    elif 't' in t0:
        s = stats[info["generation"]]; d = time.perf_counter() - t0['t']; s[0] += 1; s[1] += d; s[2] = max(s[2], d)
gc.callbacks.insert(0, cb)
def poll():
    req = f'/tmp/sg/gc_req_{port}'
    while True:
        time.sleep(0.05)
        if os.path.exists(req):
            os.remove(req)
            json.dump({"threshold": gc.get_threshold(), "stats": {str(k): v for k, v in stats.items()},
                       "tracked": len(gc.get_objects())}, open(f'/tmp/sg/gc_{port}.json', 'w'))
            stats.clear()
threading.Thread(target=poll, daemon=True).start()
sys.argv = ['jaxengine.server'] + sys.argv[1:]
runpy.run_module('jaxengine.server', run_name='__main__')
