#!/bin/bash
# Which loopback connections retransmit during a busy run: perf's tcp:tcp_retransmit_skb
# tracepoint, host-wide, attributed to the bench target's listening ports (pdkv agent, raw sink).
# usage: bash bench/results/busy/retrans_trace.sh OUTPREFIX <pdkv bench transfer args...>
OUT=$1; shift
.venv/bin/pdkv bench transfer "$@" --out $OUT.json > $OUT.log 2>&1 &
B=$!
sleep 3
T=$(pgrep -P $B -f "transfer.bench --serve --child" | head -1)
ss -tlnpH 2>/dev/null | grep "pid=$T," > $OUT.listen
timeout 600 perf record -q -e tcp:tcp_retransmit_skb -a -o $OUT.perf -- bash -c "while kill -0 $B 2>/dev/null; do sleep 0.5; done" 2>/dev/null
perf script -i $OUT.perf 2>/dev/null > $OUT.retrans
rm -f $OUT.perf
echo "# target pid $T listening:"; cat $OUT.listen
echo "# retransmissions by (sport, dport), host-wide, during the run:"
grep -o "sport=[0-9]* dport=[0-9]*" $OUT.retrans | sort | uniq -c | sort -rn | head -12
