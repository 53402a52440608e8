#!/bin/bash
# usage: serve1.sh TAG  -> one bench serve run at rate inf against :8123, server CPU time per run
cd /tmp/sg; export PYTHONPATH=${CLIENT:-/tmp/sg/base}
PORT=${PORT:-8123}; PID=$(cat /tmp/sg/server_$PORT.pid)
python /tmp/sg/thr.py snap $PID /tmp/sg/thr0.json
/tmp/sg/timing.sh $PORT /tmp/sg/tim0.json
t0=$(awk '{print $14+$15}' /proc/$PID/stat)
python -c 'import resource,runpy,sys,atexit; atexit.register(lambda: open("/tmp/sg/client_cpu","w").write(str(sum(resource.getrusage(resource.RUSAGE_SELF)[:2])))); sys.argv=["jaxengine"]+sys.argv[1:]; from jaxengine.cli import main; sys.exit(main())' bench serve --base-url http://127.0.0.1:$PORT --num-prompts ${N:-256} --input-len 16 --output-len 128 --request-rate inf --vocab-size 512 --output-json /tmp/sg/res_$1.json > /tmp/sg/res_$1.log 2>&1
python /tmp/sg/thr.py diff /tmp/sg/thr0.json $PID
/tmp/sg/timing.sh $PORT /tmp/sg/tim1.json
t1=$(awk '{print $14+$15}' /proc/$PID/stat)
python /tmp/sg/summ.py "$1" "$t0" "$t1"
