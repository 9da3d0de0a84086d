#!/usr/bin/env bash
# Build a TensorRT engine (TensorRT 10 or 11) from a Kiln DiT ONNX export with trtexec.
#
#   scripts/build_trt_engine.sh MODEL.onnx --image-size S --in-channels C
#       [--engine MODEL.plan] [--min-batch 1] [--opt-batch MAX] [--max-batch 64]
#       [--precision fp16|bf16|fp32] [--trt-version 10|11] [--print] [-- EXTRA_TRTEXEC_ARGS...]
#
# MODEL.onnx is scripts/export_dit.py's fp32 graph: inputs sample [B,C,S,S], timestep [B],
# class_labels [B] with a dynamic batch axis B; the engine gets one optimisation profile over B.
# --precision is what the engine computes in. TensorRT 10 builds from MODEL.onnx with --fp16/--bf16.
# TensorRT 11 has no precision flags (every network is strongly typed): it builds from the graph
# export_dit.py --precision P wrote in that precision next to MODEL.onnx, MODEL.P.onnx.
# The TensorRT major version comes from trtexec's banner ("[TensorRT v110100]"); --trt-version sets it.
# --print only prints the trtexec command and needs no TensorRT (with --trt-version when trtexec is absent).
set -euo pipefail

die() { echo "build_trt_engine: error: $*" >&2; exit 2; }
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

onnx="" engine="" image_size="" in_channels="" min_batch=1 opt_batch="" max_batch=64 precision=fp16 print_only=0 trt_major=""
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
    --trt-version) trt_major="${2:?--trt-version needs a value}"; shift 2 ;;
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
[[ "$precision" =~ ^(fp16|bf16|fp32)$ ]] || die "--precision must be fp16, bf16 or fp32 (got '$precision')"
engine="${engine:-${onnx%.onnx}.plan}"

# trtexec prints "&&&& RUNNING TensorRT.trtexec [TensorRT v100500] [b18] # trtexec ..." first, also
# when it rejects the arguments (TensorRT 10 has no --version option). The number is NV_TENSORRT_VERSION:
# major*10000 + minor*100 + patch from TensorRT 10 on (v100500 = 10.5.0), major*1000 + ... before (v8601).
trtexec_major() {
  local banner code
  banner="$(trtexec --version 2>&1 || true)"
  if [[ "$banner" =~ \[TensorRT\ v([0-9]+)\] ]]; then
    code=$(( 10#${BASH_REMATCH[1]} ))
    if (( code >= 100000 )); then echo $(( code / 10000 )); else echo $(( code / 1000 )); fi
  elif [[ "$banner" =~ TensorRT\ version:\ ([0-9]+)\. ]]; then  # the "[I] TensorRT version: 11.1.0" line
    echo "${BASH_REMATCH[1]}"
  fi
}

have_trtexec=0
command -v trtexec >/dev/null 2>&1 && have_trtexec=1
if [[ -z "$trt_major" ]]; then
  (( have_trtexec || !print_only )) || die "--print without trtexec on PATH needs --trt-version 10|11"
  (( have_trtexec )) || die "trtexec not found on PATH: install TensorRT (it ships trtexec, e.g. /usr/src/tensorrt/bin) on a CUDA machine, or run the command in $(dirname "$onnx")/trtexec.txt there"
  trt_major="$(trtexec_major)"
  [[ -n "$trt_major" ]] || die "could not read the TensorRT version from 'trtexec --version' (no '[TensorRT vNNNNNN]' banner); pass --trt-version 10|11"
fi
[[ "$trt_major" =~ ^[0-9]+$ ]] || die "--trt-version must be a major version number, 10 or 11 (got '$trt_major')"
(( trt_major >= 10 )) || die "TensorRT $trt_major is not supported: Kiln builds with TensorRT 10 or 11"

if (( trt_major == 10 )); then
  # Weakly typed: the fp32 graph, and the precision TensorRT may lower it to.
  case "$precision" in fp16) prec_flag=(--fp16) ;; bf16) prec_flag=(--bf16) ;; fp32) prec_flag=() ;; esac
  source_onnx="$onnx"
else
  # Strongly typed (always on from 11; --stronglyTyped is a no-op there): the graph decides.
  prec_flag=()
  source_onnx="$onnx"
  [[ "$precision" == fp32 ]] || source_onnx="${onnx%.onnx}.$precision.onnx"
fi

shapes() {  # shapes BATCH -> sample:Bx C xSxS,timestep:B,class_labels:B
  echo "sample:${1}x${in_channels}x${image_size}x${image_size},timestep:${1},class_labels:${1}"
}
cmd=(trtexec "--onnx=$source_onnx" "--saveEngine=$engine"
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

(( have_trtexec )) || die "trtexec not found on PATH: install TensorRT (it ships trtexec, e.g. /usr/src/tensorrt/bin) on a CUDA machine, or run the command in $(dirname "$onnx")/trtexec.txt there"
if [[ ! -f "$source_onnx" ]]; then
  [[ "$source_onnx" == "$onnx" ]] && die "no such ONNX file: $onnx"
  die "no $precision graph at $source_onnx: TensorRT $trt_major takes the precision from the ONNX; write it with scripts/export_dit.py EXPORT_DIR --precision $precision"
fi
echo "build_trt_engine: TensorRT $trt_major: ${cmd[*]}"
"${cmd[@]}"
[[ -s "$engine" ]] || die "trtexec finished but wrote no engine at $engine"
echo "build_trt_engine: wrote $engine"
