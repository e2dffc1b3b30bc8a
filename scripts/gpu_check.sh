#!/usr/bin/env bash
# The GPU check: everything commlab does on CUDA tensors and NCCL, in one go, with its figures in one file.
#
#   bash scripts/gpu_check.sh                 # on a machine with CUDA GPUs (under 8 minutes on one GPU)
#   bash scripts/gpu_check.sh --dry-run       # the same steps on gloo CPU ranks with small sizes (CI runs it)
#   bash scripts/gpu_check.sh --out FILE      # where the report goes (default gpu_check.txt)
#
# Steps, each with a time limit, each one's output appended to the report:
#   1. torchrun with NCCL at world size 1: python -m commlab selftest (ring, mesh + TP layer, DP step);
#   2. every compressor's round trip (and error feedback) on CUDA tensors against the CPU result;
#   3. compressor encode + decode throughput on the GPU beside the torch primitive (bench --compressors);
#   4. bucketed DP (plain, commlab hook, torch's fp16 wrapper, PowerSGD), pipeline GPipe/1F1B (and interleaved
#      1F1B from 2 ranks on), ZeRO-1, ZeRO-2/3 (ShardedDataParallel: async collectives, resized CUDA storage)
#      and the digits trainer on CUDA under torchrun, with their clock marks;
#   5. bench --backend nccl (commlab ring vs dist.all_reduce) under torchrun at world size 1;
#   5b. the capstone (labs/capstone/train.py) on NCCL at world size 1: tokens/s, MFU and the time split;
#   6. with >= 2 GPUs: every AllReduce algorithm, ReduceScatter, AllGather and AllToAllV on NCCL, the steps
#      of 4 and the AllReduce table on all GPUs.
# --dry-run runs steps 1-5b and 6a on 2 gloo ranks (6a in step 4's torchrun; 6b and 6c would repeat 4 and 5
# there), with small sizes, so that every step's logic runs in CI. The exit status is the number of failed
# steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT=gpu_check.txt
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (use --dry-run, --out FILE)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TORCHRUN=("$PY" -m torch.distributed.run --standalone --max-restarts 0)

if [ "$DRY" = 1 ]; then
  # Step 5 from 64K: the same table in two rows (small messages cost a scheduler wait each on shared cores).
  BACKEND=gloo; DEVICE=cpu; NGPU=2; MIN_SIZE=64K; SIZE=256K; NUMEL=4096; CAPSTONE_STEPS=6
else
  # One interpreter start for both: the GPU count and, for the refusal, torch's version.
  read -r NGPU TORCH_VERSION < <("$PY" -c "import torch; print(torch.cuda.device_count(), torch.__version__)" 2>/dev/null)
  [[ ${NGPU:-} =~ ^[0-9]+$ ]] || { NGPU=0; TORCH_VERSION=$("$PY" -c 'import torch' 2>&1); }   # why no torch
  if [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: no CUDA GPU is visible to torch ($TORCH_VERSION);" \
         "run with --dry-run to check the script on CPU" >&2
    exit 2
  fi
  BACKEND=nccl; DEVICE=cuda; MIN_SIZE=1K; SIZE=64M; NUMEL=$((1 << 22)); CAPSTONE_STEPS=20
fi

: > "$OUT"
{
  if [ "$DRY" = 1 ]; then WHAT="CPU ranks standing in for GPUs: $NGPU"; else WHAT="GPUs: $NGPU"; fi
  echo "# commlab GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), dry run: $DRY, backend $BACKEND, $WHAT"
  "$PY" -c "import torch; print('# torch', torch.__version__, '| CUDA', torch.version.cuda, '| NCCL',
            '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-')"
  [ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# GPU: /'
} >> "$OUT"

FAILED=0
SUMMARY=()
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  echo "== $name" | tee -a "$OUT"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} timeout --kill-after 10 "$limit" "$@" >> "$OUT" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  if [ $rc -eq 0 ]; then SUMMARY+=("ok      ${took}s  $name"); else
    FAILED=$((FAILED + 1))
    [ $rc -eq 124 ] && SUMMARY+=("TIMEOUT ${took}s  $name (limit ${limit}s)") || SUMMARY+=("FAILED  ${took}s  $name (exit $rc)")
  fi
  echo "   exit $rc after ${took}s" | tee -a "$OUT"
}

ONE=1; [ "$DRY" = 1 ] && ONE=2   # gloo at world size 1 would not exercise any message
step "1. torchrun, $BACKEND, world $ONE: selftest" 120 \
  "${TORCHRUN[@]}" --nproc-per-node $ONE -m commlab selftest --backend $BACKEND
step "2. compressor round trips on $DEVICE vs CPU" 120 "$PY" scripts/gpu_check.py codecs --device $DEVICE --numel $NUMEL
step "3. compressor throughput on $DEVICE vs the torch primitive" 150 \
  "$PY" -m commlab bench --compressors --device $DEVICE -e $SIZE -r 3 -n 2
if [ "$DRY" = 1 ]; then PARTS=(steps collectives); ALSO=" + 6a's collectives"; else PARTS=(steps); ALSO=; fi
step "4. DP, pipeline, ZeRO-1/2/3, trainer on $DEVICE (torchrun, world $ONE)$ALSO" 120 \
  "${TORCHRUN[@]}" --nproc-per-node $ONE scripts/gpu_check.py "${PARTS[@]}"
step "5. bench --backend $BACKEND, world $ONE" 120 \
  "${TORCHRUN[@]}" --nproc-per-node $ONE -m commlab bench --backend $BACKEND -b $MIN_SIZE -e $SIZE -r 3
step "5b. capstone, $BACKEND, world $ONE: tokens/s, MFU, time split" 150 \
  "${TORCHRUN[@]}" --nproc-per-node $ONE labs/capstone/train.py --dp $ONE --steps $CAPSTONE_STEPS --backend $BACKEND
if [ "$NGPU" -ge 2 ]; then
  if [ "$DRY" = 1 ]; then
    # A dry run's steps 4 and 5 already ran these at world 2 ($ONE): one torchrun start, not four.
    SUMMARY+=("same        6a. collectives on $NGPU ranks: dry run, in step 4's torchrun")
    SUMMARY+=("same        6b. DP, pipeline, ZeRO-1/2/3, trainer on $NGPU ranks: dry run, step 4's command")
    SUMMARY+=("same        6c. bench, world $NGPU: dry run, step 5's command")
  else
    step "6a. collectives on $NGPU ranks ($BACKEND)" 120 \
      "${TORCHRUN[@]}" --nproc-per-node $NGPU scripts/gpu_check.py collectives
    step "6b. DP, pipeline, ZeRO-1/2/3, trainer on $NGPU ranks ($BACKEND)" 120 \
      "${TORCHRUN[@]}" --nproc-per-node $NGPU scripts/gpu_check.py steps
    step "6c. bench --backend $BACKEND, world $NGPU" 150 \
      "${TORCHRUN[@]}" --nproc-per-node $NGPU -m commlab bench --backend $BACKEND -b 1K -e $SIZE -r 3
  fi
else
  SUMMARY+=("skipped     6. multi-GPU NCCL collectives and pipeline (one GPU: NCCL refuses two ranks on one GPU)")
fi

{
  echo "# summary"
  printf '%s\n' "${SUMMARY[@]}"
  echo "# $FAILED step(s) failed"
} | tee -a "$OUT"
echo "report: $OUT"
exit $FAILED
