#!/bin/bash
# run_line.sh VERSION MODE(eager|compiled) [wrapper...]: one engine run, log in logs/VERSION-MODE.log
V=$1; M=$2; shift 2
ROOT=/work/scratch/envs
. $ROOT/runenv.sh
export TORCHINDUCTOR_CACHE_DIR=$ROOT/cache/inductor/$V-$M-$(date +%s)
mkdir -p $ROOT/logs
s=$(date +%s)
timeout 1500 nice -n 19 "$@" $ROOT/venvs/vllm-$V/bin/python $ROOT/run_tiny.py $M > $ROOT/logs/$V-$M.log 2>&1
rc=$?
echo "rc=$rc wall=$(( $(date +%s) - s ))s" >> $ROOT/logs/$V-$M.log
grep -E "^IDS|^RESULT|Warming|init engine|took|^rc=" $ROOT/logs/$V-$M.log | sed -E "/(INFO|WARNING)/ s/.*\] //" | cut -c1-200
[ $rc = 0 ] || grep -E "Error|error|Exception" $ROOT/logs/$V-$M.log | tail -8 | cut -c1-400
