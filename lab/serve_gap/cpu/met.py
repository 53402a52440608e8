import re,sys,urllib.request,json
t=urllib.request.urlopen('http://localhost:8123/metrics').read().decode()
d={}
for name in ('time_to_first_token_seconds','request_queue_time_seconds','request_prefill_time_seconds','e2e_request_latency_seconds'):
    for k in ('sum','count'):
        m=re.search(r'^jaxengine:%s_%s\{[^}]*\} (\S+)'%(name,k), t, re.M)
        if m: d[name+'_'+k]=float(m.group(1))
if sys.argv[1]=='snap': json.dump(d,open('/tmp/sg/met0.json','w'))
else:
    a=json.load(open('/tmp/sg/met0.json'))
    for name in ('time_to_first_token_seconds','request_queue_time_seconds','request_prefill_time_seconds'):
        if name+'_count' in d:
            n=d[name+'_count']-a[name+'_count']; print(name, 'mean %.3f over %d'%((d[name+'_sum']-a[name+'_sum'])/n, n))
