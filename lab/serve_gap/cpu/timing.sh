#!/bin/bash
# timing.sh PORT OUT: asks the server for its engine timing
rm -f /tmp/sg/timing_$1.json; touch /tmp/sg/timing_req_$1
for i in $(seq 100); do [ -f /tmp/sg/timing_$1.json ] && break; sleep 0.05; done
cp /tmp/sg/timing_$1.json $2
