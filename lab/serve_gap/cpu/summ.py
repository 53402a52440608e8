import json,sys,os
tag,t0,t1=sys.argv[1],int(sys.argv[2]),int(sys.argv[3])
m=json.load(open(f'/tmp/sg/res_{tag}.json'))['results']
cpu=(t1-t0)/os.sysconf('SC_CLK_TCK')
ccpu=float(open('/tmp/sg/client_cpu').read())
rec=dict(tag=tag, out_tok_s=m['output_throughput'], duration_s=m['duration_s'], tpot_mean_ms=m['tpot_ms']['mean'],
         ttft_mean_ms=m['ttft_ms']['mean'], server_cpu_s=cpu, client_cpu_s=ccpu, load1=os.getloadavg()[0], completed=m['completed'])
a=json.load(open('/tmp/sg/tim0.json')); b=json.load(open('/tmp/sg/tim1.json'))
rec['engine']={k: b[k]-a[k] for k in ('steps','step_s','device_wait_s')}; rec['switch']=b['switch']
rec['chunks']=sum(len(x['itl_s'])+1 for x in json.load(open(f'/tmp/sg/res_{tag}.json'))['requests'])
rec['threads']=json.load(open('/tmp/sg/thrd.json'))
open('/tmp/sg/runs.jsonl','a').write(json.dumps(rec)+'\n')
print(f"{tag}: {rec['out_tok_s']:.0f} out tok/s, dur {rec['duration_s']:.2f} s, TPOT mean {rec['tpot_mean_ms']:.1f} ms, TTFT mean {rec['ttft_mean_ms']:.0f} ms, server cpu {cpu:.2f} s, client cpu {ccpu:.2f} s, load {rec['load1']:.2f}, steps {rec['engine']['steps']} step {rec['engine']['step_s']/max(1,rec['engine']['steps'])*1e3:.1f} ms (device wait {rec['engine']['device_wait_s']/max(1,rec['engine']['steps'])*1e3:.1f}), chunks {rec['chunks']}, switch {rec['switch']}")
