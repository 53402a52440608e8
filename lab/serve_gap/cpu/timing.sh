#!/bin/bash
# timing.sh PORT OUT: asks the server for its engine timing
D=${SERVE_GAP_DIR:-/tmp/sg}; rm -f $D/timing_$1.json; touch $D/timing_req_$1
for i in $(seq 100); do [ -f $D/timing_$1.json ] && break; sleep 0.05; done
cp $D/timing_$1.json $2
