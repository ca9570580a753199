#!/usr/bin/env bash
# The GPU check: one command for the minutes a GPU is lent, each step under its own time limit, all output in one
# folder (DIR/summary.txt: a line per step with its exit code and seconds; DIR/<step>.log: its whole output).
#
#   bash tests/gpu_check.sh [DIR]        (DIR defaults to runs/gpu_check)
#
# It needs torch >= 2.11 with CUDA, pytest, ninja and a C++ compiler, and no package index. Without CUDA the steps
# that need a real GPU say "skipped" with the reason, and the rest runs on the fake CUDA device at its smallest size
# (tests/test_gpu_check.py runs it so in CI). The steps:
#   env        the driver, torch, CUDA, NCCL, the compiler and ninja
#   facts      tests/gpu_facts.py: what the fake device assumes (cuBLAS workspaces in memory_allocated, the stream NCCL's
#              kernels run on, a resize_(0) block handed straight back, which copies and constructors synchronize)
#   cpu_adam   the C++ AdamW built for this host
#   first      README's first command, with the GPU (stage 3, the tiny GPT)
#   offload_gpu  bench/offload_gpu.py (the ZeRO-Offload paper's headline: TFLOP/s per GPU as the batch grows, each
#              ratio beside its prediction), early and within OFFLOAD_GPU_S seconds (200): the rows it has no time for
#              say so (a lent GPU's minutes are few, and an H200 took 365 s for the steps after it)
#   suite      tests/test_gpu.py --gpu: parity with the CUDA reference and the ledgers, every stage and offload mode
#   overlap    tests/test_gpu.py --gpu -k "overlap or mostly": copies and gathers beside compute kernels, from profiler
#              traces, and the fractions of offload's copies and delayed update under compute (gpt2, one rank)
#   timeline   bench/timeline.py on a real trace: stage 3 and offload, one rank
#   repeat     stage 3 in fp32 and bf16 run twice, and stopped and resumed: which are bit for bit on this GPU
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_check}"
mkdir -p "$out"
: > "$out/summary.txt"
export PYTHONUNBUFFERED=1 NVIDIA_TF32_OVERRIDE=0
# python3: the GPU machine has no plain `python`; torchrun as a module, since its script may not be on PATH.
py="${PYTHON:-python3}"
if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  gpu=1
else
  gpu=0
fi

# step NAME SECONDS COMMAND...: run one step under its limit, its output in DIR/NAME.log, its line in the summary.
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local verdict="ok"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMED OUT"; elif [ $rc -ne 0 ]; then verdict="FAILED"; fi
  echo "$name: $verdict (exit $rc, $((SECONDS - start)) s)" | tee -a "$out/summary.txt"
  tail -n 12 "$out/$name.log"
}

skip() {
  echo "$1: skipped ($2)" | tee -a "$out/summary.txt"
}

environment() {
  nvidia-smi || echo "nvidia-smi: not found"
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  "$py" -c "import torch; print('nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  c++ --version | head -1
  ninja --version
  nvcc --version | tail -1 || true
  nproc
}

# The same run twice, and stopped after 3 steps and resumed, per dtype: which agree bit for bit on this device.
repeat() {
  local dtype run
  for dtype in fp32 bf16; do
    run=("$py" stage3.py --preset tiny --steps 6 --eval_every 1000 --sample_chars 0 --no_progress --dtype "$dtype")
    "${run[@]}" --out "$out/repeat_$dtype.a.json" --save_master "$out/repeat_$dtype.a.pt" > /dev/null || return 1
    "${run[@]}" --out "$out/repeat_$dtype.b.json" --save_master "$out/repeat_$dtype.b.pt" > /dev/null || return 1
    "${run[@]}" --stop_after 3 --ckpt_dir "$out/repeat_ckpt_$dtype" > /dev/null || return 1
    "${run[@]}" --resume "$out/repeat_ckpt_$dtype" --out "$out/repeat_$dtype.c.json" \
      --save_master "$out/repeat_$dtype.c.pt" > /dev/null || return 1
  done
  "$py" - "$out" <<'PY'
import json, sys, torch
out = sys.argv[1]
for dtype in ("fp32", "bf16"):
    runs = {k: (json.load(open(f"{out}/repeat_{dtype}.{k}.json")), torch.load(f"{out}/repeat_{dtype}.{k}.pt"))
            for k in "abc"}
    def same(k):
        (sa, ma), (sb, mb) = runs["a"], runs[k]
        return sa["losses"] == sb["losses"] and all(torch.equal(ma[n], mb[n]) for n in ma)
    print(f"stage3 {dtype} on {runs['a'][0]['device']}: run twice bit for bit: {same('b')}; "
          f"stopped and resumed bit for bit: {same('c')}")
PY
}
export py out
export -f environment repeat
step env 60 bash -c environment
step facts 120 "$py" tests/gpu_facts.py "$out/facts.json"
step cpu_adam 240 "$py" -c "from offload import load_cpu_adam; load_cpu_adam(announce=True)"
if [ $gpu -eq 1 ]; then
  step first 180 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 stage3.py --preset tiny --steps 300
  # the bench stops starting runs 30 s before its step's limit (its last run's summary, table and picture after it)
  budget=${OFFLOAD_GPU_S:-200}
  step offload_gpu $((budget + 30)) "$py" bench/offload_gpu.py --budget_s "$budget" --out_dir "$out/offload_gpu"
  step suite 420 "$py" -m pytest tests/test_gpu.py --gpu -q -k "parity or ledgers" -p no:cacheprovider
  step overlap 360 "$py" -m pytest tests/test_gpu.py --gpu -q -k "overlap or mostly" -p no:cacheprovider
  step timeline_stage3 180 "$py" bench/timeline.py stage3.py --nproc 1 --preset small --out "$out/timeline_stage3"
  step timeline_offload 240 "$py" bench/timeline.py offload.py --nproc 1 --preset small --out "$out/timeline_offload"
  step repeat 240 bash -c repeat
else
  skip first "no CUDA GPU: README's first command runs on the CPU in tests/test_commands.py"
  skip offload_gpu "no CUDA GPU: tests/test_offload_gpu.py runs it at its smallest size on the fake device"
  # (test_gpu.py's runs on the fake device are the CPU suite's own: here only its trace reader, to show the step runs)
  step suite 300 "$py" -m pytest tests/test_gpu.py -q -k timeline_reader -p no:cacheprovider
  skip overlap "no CUDA GPU: overlap is read from a real GPU's profiler trace"
  # bench/timeline.py on the fake CUDA device in every process it starts (2 fake GPUs), at its smallest size.
  fake=(env PYTHONPATH="$PWD/tests/fake_cuda_site" FAKE_CUDA=2 FAKE_CUDA_FINDINGS="$out/fake_findings")
  tiny=(--nproc 2 --preset tiny --n_layer 2 --steps 3 --device cuda)
  step timeline_stage3 300 "${fake[@]}" "$py" bench/timeline.py stage3.py "${tiny[@]}" --out "$out/timeline_stage3"
  step timeline_offload 300 "${fake[@]}" "$py" bench/timeline.py offload.py "${tiny[@]}" --out "$out/timeline_offload"
  skip repeat "no CUDA GPU: resume on the CPU is tests/test_checkpoint.py's, bit for bit"
fi
echo "== summary ($out/summary.txt)"
cat "$out/summary.txt"
! grep -q -e "FAILED" -e "TIMED OUT" "$out/summary.txt"
