import json,sys,numpy as np
d=json.load(open(sys.argv[1]));q=d['requests']
tt=np.sort([r['ttft_s'] for r in q]); print('duration %.2f out tok/s %.0f ttft min %.3f  10th %.3f 256th %.3f median %.3f' % (d['results']['duration_s'], d['results']['output_throughput'], tt[0], tt[9], tt[min(255,len(tt)-1)], np.median(tt)))
