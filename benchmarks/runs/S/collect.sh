#!/usr/bin/env bash
# Wait for run S's runner (at most $1 s), then pack /tmp/S into $OUT (only a few files come back).
lim=${1:-540}; s=$(date +%s)
while [ ! -e /tmp/S/done ] && [ $(( $(date +%s)-s )) -lt "$lim" ]; do sleep 5; done
cat /tmp/S/t.log 2>/dev/null; tail -3 /tmp/S/*.log 2>/dev/null | tail -80
(cd /tmp && tar czf "$OUT/S.tgz" S)
