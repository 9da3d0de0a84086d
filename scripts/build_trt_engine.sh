#!/usr/bin/env bash
# Build a TensorRT engine from a Kiln DiT ONNX export with trtexec.
#
#   scripts/build_trt_engine.sh MODEL.onnx --image-size S --in-channels C
#       [--engine MODEL.plan] [--min-batch 1] [--opt-batch MAX] [--max-batch 64]
#       [--precision fp16|bf16|fp32] [--print] [-- EXTRA_TRTEXEC_ARGS...]
#
# The ONNX graph (recipes/dit/onnx.py) has inputs sample [B,C,S,S], timestep [B], class_labels [B]
# with a dynamic batch axis B; the engine gets one optimisation profile over B.
# --print only prints the trtexec command (scripts/export_dit.py records it in trtexec.txt) and
# needs no TensorRT. Needs trtexec on PATH (it ships with TensorRT) to build.
set -euo pipefail

die() { echo "build_trt_engine: error: $*" >&2; exit 2; }
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

onnx="" engine="" image_size="" in_channels="" min_batch=1 opt_batch="" max_batch=64 precision=fp16 print_only=0
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --engine) engine="${2:?--engine needs a value}"; shift 2 ;;
    --image-size) image_size="${2:?--image-size needs a value}"; shift 2 ;;
    --in-channels) in_channels="${2:?--in-channels needs a value}"; shift 2 ;;
    --min-batch) min_batch="${2:?--min-batch needs a value}"; shift 2 ;;
    --opt-batch) opt_batch="${2:?--opt-batch needs a value}"; shift 2 ;;
    --max-batch) max_batch="${2:?--max-batch needs a value}"; shift 2 ;;
    --precision) precision="${2:?--precision needs a value}"; shift 2 ;;
    --print) print_only=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z "$onnx" ]] || die "more than one ONNX path given ($onnx, $1)"; onnx="$1"; shift ;;
  esac
done

[[ -n "$onnx" ]] || { usage >&2; die "no ONNX path given"; }
[[ -n "$image_size" && -n "$in_channels" ]] || die "--image-size and --in-channels are required (see the export's kiln.json)"
for v in "$image_size" "$in_channels" "$min_batch" "$max_batch" ${opt_batch:+"$opt_batch"}; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || die "sizes must be positive integers (got '$v')"
done
opt_batch="${opt_batch:-$max_batch}"
(( min_batch <= opt_batch && opt_batch <= max_batch )) || die "need min-batch <= opt-batch <= max-batch (got $min_batch, $opt_batch, $max_batch)"
case "$precision" in
  fp16) prec_flag=(--fp16) ;;
  bf16) prec_flag=(--bf16) ;;
  fp32) prec_flag=() ;;
  *) die "--precision must be fp16, bf16 or fp32 (got '$precision')" ;;
esac
engine="${engine:-${onnx%.onnx}.plan}"

shapes() {  # shapes BATCH -> sample:Bx C xSxS,timestep:B,class_labels:B
  echo "sample:${1}x${in_channels}x${image_size}x${image_size},timestep:${1},class_labels:${1}"
}
cmd=(trtexec "--onnx=$onnx" "--saveEngine=$engine"
     "--minShapes=$(shapes "$min_batch")" "--optShapes=$(shapes "$opt_batch")" "--maxShapes=$(shapes "$max_batch")"
     ${prec_flag[@]+"${prec_flag[@]}"} ${extra[@]+"${extra[@]}"})

if (( print_only )); then
  out=()
  for a in "${cmd[@]}"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+=("$a"); else out+=("$(printf '%q' "$a")"); fi
  done
  echo "${out[*]}"
  exit 0
fi

command -v trtexec >/dev/null 2>&1 || die "trtexec not found on PATH: install TensorRT (it ships trtexec, e.g. /usr/src/tensorrt/bin) on a CUDA machine, or run the command in $(dirname "$onnx")/trtexec.txt there"
[[ -f "$onnx" ]] || die "no such ONNX file: $onnx"
echo "build_trt_engine: ${cmd[*]}"
"${cmd[@]}"
[[ -s "$engine" ]] || die "trtexec finished but wrote no engine at $engine"
echo "build_trt_engine: wrote $engine"
