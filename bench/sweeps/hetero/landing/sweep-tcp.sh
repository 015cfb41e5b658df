cd "$(dirname "$0")"
for model in llama-3-70b-tp8 llama-3-8b; do
for m in "--hetero tp2:tp4" "--hetero tp4:tp2" "--hetero tp2:tp4 --hetero-mode pull" "--hetero tp4:tp2 --hetero-mode pull"; do
./run.sh old "PDKV_BENCH_TCP_LAND_BELOW=512 PDKV_BENCH_PIECE_COPY=memcpy" $m --transport tcp --model $model
./run.sh new "X=1" $m --transport tcp --model $model
./run.sh direct "PDKV_BENCH_NO_STAGING=1" $m --transport tcp --model $model
done; done
