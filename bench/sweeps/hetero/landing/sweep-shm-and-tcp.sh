cd "$(dirname "$0")"
for model in llama-3-70b-tp8 llama-3-8b; do
for t in tcp shm; do
for m in "--hetero tp2:tp4" "--hetero tp4:tp2" "--hetero tp2:tp4 --hetero-mode pull" "--hetero tp4:tp2 --hetero-mode pull"; do
if [ $t = tcp ]; then old="PDKV_BENCH_TCP_LAND_BELOW=512 PDKV_BENCH_PIECE_COPY=memcpy"; else old="PDKV_BENCH_PIECE_COPY=memcpy"; fi
./run.sh old "$old" $m --transport $t --model $model
./run.sh new "X=1" $m --transport $t --model $model
done; done; done
