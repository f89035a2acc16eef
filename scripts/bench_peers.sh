#!/usr/bin/env bash
# Peer benchmark in one command (GitHub issue 6, item 1): our runtime against transformers,
# ONNX Runtime GenAI, llama.cpp (llama-cpp-python) and optimum on the same weights, prompts,
# precision and thread count, batch 1 and 4; our int8 / int4 bundles against llama.cpp's Q8_0 / Q4_1 (Q4_0 too),
# GGUFs of the same checkpoint. Writes bench/results/peers.{json,csv,png} and prints a Markdown table.
#
#   scripts/bench_peers.sh [--num-prompts 8] [--max-new-tokens 128] [--batch-sizes 1 4] [--threads N]
#                          [--llamacpp-n-batch 1]   (Intel AMX CPUs: see LLAMACPP_N_BATCH in bench/peers.py)
#
# The arguments go to `bench/peers.py prompts` (see its --help). Environment:
#   PEER_ENVS  venvs, converted models and logs, outside the repository
#              (default ${XDG_CACHE_HOME:-~/.cache}/mars-edge-peers)
#   BUNDLE     our bundle (default bundles/default-mars-b4, exported here if missing)
#   MODEL      model spec the bundle was exported from (default default-mars)
#   ENGINES    engines to run (default "ours transformers ortgenai llamacpp optimum"); the rows of
#              the others stay in $PEER_ENVS/work and join the report if their settings match
#              (rows of other settings are left out, named on stderr and in peers.json's meta);
#              ENGINES=ours installs nothing and writes no checkpoint (the CI smoke test runs it)
#   QUANTIZED  our weight-only quantized bundles run with ours (default "int8 int4"; "" for none):
#              $BUNDLE-int8 and $BUNDLE-int4, exported from $MODEL if missing; variants "int8 ar" ...
#   FUSED      our fused-graph bundles (mars-export --graph fused; batch 1) run with ours (default
#              "float32 int8"; also int4; "" for none): $BUNDLE-fused, $BUNDLE-fusedint8 and $BUNDLE-fusedint4,
#              exported if missing; variants "fused ar", "fused int8 ar", "fused int4 ar" ...
#   OUT        result folder (default bench/results)
#   ROUNDS     times to run the engines (default 1). With N > 1 the engines run N times, in ENGINES'
#              order in odd rounds and reversed in even ones, each round's report in $OUT/round1 ..
#              $OUT/roundN (run logs: NAME.run.roundK.log); bench/peers_runs.py then sums them up in
#              $OUT/peers_runs.* (each row's decode tok/s and ours / peer within each round, median,
#              min and max over the rounds): the drift of a shared machine between minutes shows in
#              the spread instead of deciding a single ratio. Only the engines run now are in the
#              rounds (no earlier rows join them), and a setup that failed is not retried
#   ORTGENAI_PINS, OPTIMUM_PINS, LLAMACPP_PINS, LLAMACPP_CMAKE_ARGS, GGUF_PINS  override a peer's pins
#
# Each peer gets its own venv with exact pins (their pins conflict with the project's).
# Everything slow happens once and is reused: a venv is reinstalled only when its pins
# change; the HF checkpoint, GenAI model, optimum export and GGUF files are kept (delete
# them to redo). GGUFs: F32 and Q8_0 from convert_hf_to_gguf.py, Q4_0 and Q4_1 from llama.cpp's
# own quantizer on the F32 file (bench/peers.py quantize-gguf, in the llamacpp venv). Q8_0 is
# our int8 bundle's scheme; Q4_1 holds the kind of weights our int4 bundle of the default model
# imports from its GGUF (Q4_1 blocks): the closest like-for-like row for it. llama-cpp-python
# ships only a source distribution: it compiles llama.cpp (10-30 min on 2 cores). A peer that
# cannot be installed or run becomes a row with its status and the key line of its log. Setup
# and run logs: $PEER_ENVS/logs.
set -euo pipefail
cd "$(dirname "$0")/.."

PEER_ENVS=${PEER_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/mars-edge-peers}
BUNDLE=${BUNDLE:-bundles/default-mars-b4}
MODEL=${MODEL:-default-mars}
ENGINES=${ENGINES:-ours transformers ortgenai llamacpp optimum}
QUANTIZED=${QUANTIZED-int8 int4}
FUSED=${FUSED-float32 int8}
OUT=${OUT:-bench/results}
ROUNDS=${ROUNDS:-1}
LOGS=$PEER_ENVS/logs
WORK=$PEER_ENVS/work
CKPT=$PEER_ENVS/ckpt/$(basename "$MODEL")
NAME=$(basename "$CKPT")
PY=.venv/bin/python

LLAMACPP_VERSION=0.3.36
ORTGENAI_PINS=${ORTGENAI_PINS:-"onnxruntime-genai==0.18.0 onnxruntime==1.32.0 torch==2.13.0 transformers==5.24.0 onnx==1.23.2 onnx-ir==1.1.0 onnxscript==0.7.2 numpy==2.4.6"}
OPTIMUM_PINS=${OPTIMUM_PINS:-"optimum-onnx==0.1.0 optimum==2.1.0 transformers==4.57.6 onnxruntime==1.32.0 torch==2.13.0 numpy==2.4.6"}
LLAMACPP_PINS=${LLAMACPP_PINS:-"llama-cpp-python==$LLAMACPP_VERSION numpy==2.4.6"}
LLAMACPP_CMAKE_ARGS=${LLAMACPP_CMAKE_ARGS:-"-DGGML_NATIVE=ON"}
LLAMACPP_SRC=$PEER_ENVS/src/llama_cpp_python-$LLAMACPP_VERSION
GGUF_PINS=${GGUF_PINS:-"torch==2.13.0 transformers==4.57.6 sentencepiece==0.2.3 protobuf==4.25.9 numpy==2.4.6 $LLAMACPP_SRC/vendor/llama.cpp/gguf-py"}

case $ROUNDS in ''|*[!0-9]*|0*) echo "error: ROUNDS takes a whole number of rounds >= 1, got '$ROUNDS'" >&2; exit 2 ;; esac
read -ra ENGINE_LIST <<<"$ENGINES"  # split on blanks, no file-name expansion
for engine in "${ENGINE_LIST[@]}"; do
    case $engine in ours|transformers|ortgenai|optimum|llamacpp) ;;
        *) echo "error: unknown engine '$engine'; choose from: ours transformers ortgenai llamacpp optimum" >&2; exit 2 ;;
    esac
done
for dtype in $QUANTIZED; do
    case $dtype in int8|int4) ;; *) echo "error: QUANTIZED takes int8 and/or int4, got '$dtype'" >&2; exit 2 ;; esac
done
for dtype in $FUSED; do
    case $dtype in float32|int8|int4) ;; *) echo "error: FUSED takes float32, int8 and/or int4, got '$dtype'" >&2; exit 2 ;; esac
done
mkdir -p "$LOGS" "$WORK"
if [ "$ROUNDS" -gt 1 ]; then  # rounds compare the engines run now, round by round: no earlier rows join them
    rm -f "$WORK"/rows-*.json
else  # rows of engines not run now stay; the report leaves them out if the settings differ
    for engine in "${ENGINE_LIST[@]}"; do rm -f "$WORK/rows-$engine.json" "$WORK/rows-$engine"-*.json; done
fi
RUN_LOG_TAG=""  # .roundK while rounds run: each round keeps its run logs
FAILED_SETUPS=" "  # venvs whose install failed in this run: later rounds do not try again

step() {  # step NAME LOG CMD...: run CMD into LOG, note its exit status and seconds in setup.tsv
    local name=$1 log=$2 start=$SECONDS rc=0
    shift 2
    echo "== $name (log: $log)"
    "$@" >"$log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$WORK/setup.tsv"
    [ "$rc" -eq 0 ] || echo "   failed (exit $rc): $(grep -iE 'error' "$log" | tail -1 | cut -c1-200)"
    return "$rc"
}

setup_venv() {  # setup_venv NAME [--cmake-args ARGS] PINS...: a venv under $PEER_ENVS with exactly these pins
    # (skipped if unchanged). --cmake-args: a package compiled here (llama-cpp-python) is built with CMAKE_ARGS=ARGS,
    # which counts as a pin: other ARGS rebuild it, past pip's cache of the wheel built with the old ones
    local name=$1 venv=$PEER_ENVS/$1 with=() fresh=()
    shift
    if [ "${1:-}" = --cmake-args ]; then
        with=(env "CMAKE_ARGS=$2") fresh=(--no-cache-dir --force-reinstall)
        shift 2
    fi
    local key="$*${with[1]:+ ${with[1]}}"
    if [ -f "$venv/.pins" ] && [ "$(cat "$venv/.pins")" = "$key" ]; then
        return 0
    fi
    case $FAILED_SETUPS in *" $name "*) return 1 ;; esac
    [ -x "$venv/bin/python" ] || "$BASE_PYTHON" -m venv "$venv"
    step "install $name" "$LOGS/$name.install.log" "${with[@]}" "$venv/bin/pip" install --disable-pip-version-check \
        "${fresh[@]}" "$@" || { FAILED_SETUPS="$FAILED_SETUPS$name "; return 1; }
    echo "$key" >"$venv/.pins"
}

record() {  # record ENGINE STATUS LOG [--tag TAG] [--exit-status N]: a status row with the key line of LOG
    # (and how the failed command ended: a crash's log may end on an ordinary line)
    "$PY" bench/peers.py record --engine "$1" --work "$WORK" --status "$2" --log "$3" "${@:4}"
}

run_engine() {  # run_engine ENGINE PYTHON [--tag TAG] ARGS...: one engine (TAG: another model of it) in its own
    local engine=$1 python=$2 name=$1 tag=()  # process; a crash becomes a row
    shift 2
    if [ "${1:-}" = --tag ]; then name=$engine-$2 tag=(--tag "$2"); shift 2; fi
    local log=$LOGS/$name.run$RUN_LOG_TAG.log
    if step "run $name" "$log" "$python" bench/peers.py run --engine "$engine" "${tag[@]}" --work "$WORK" "$@"; then
        grep -E 'tok/s|^error' "$log" || true
    else
        record "$engine" failed "$log" "${tag[@]}" --exit-status "$?"
    fi
}

ours_variant() {  # ours_variant TAG EXPORT_FLAGS...: our bundle $BUNDLE-TAG (exported with the flags if missing)
    local tag=$1 bundle=$BUNDLE-$1
    shift
    if [ ! -f "$bundle/mars_config.json" ]; then
        step "export $tag bundle" "$LOGS/bundle-$tag.export.log" .venv/bin/mars-export "$MODEL" --block 4 \
            "$@" -o "$bundle" \
            || { record ours failed "$LOGS/bundle-$tag.export.log" --tag "$tag" --exit-status "$?"; return; }
    fi
    run_engine ours "$PY" --tag "$tag" --model "$bundle"
}

peer_ortgenai() {
    local venv=$PEER_ENVS/ortgenai model=$PEER_ENVS/ortgenai-model/$NAME
    # shellcheck disable=SC2086
    setup_venv ortgenai $ORTGENAI_PINS || { record ortgenai "not installable here" "$LOGS/ortgenai.install.log"; return; }
    if [ ! -f "$model/genai_config.json" ]; then
        step "build ortgenai model" "$LOGS/ortgenai.build.log" "$venv/bin/python" -m onnxruntime_genai.models.builder \
            -i "$CKPT" -o "$model" -p fp32 -e cpu -c "$PEER_ENVS/cache/ortgenai" \
            || { record ortgenai failed "$LOGS/ortgenai.build.log" --exit-status "$?"; return; }
    fi
    run_engine ortgenai "$venv/bin/python" --model "$model"
}

peer_optimum() {
    local venv=$PEER_ENVS/optimum model=$PEER_ENVS/optimum-model/$NAME
    # shellcheck disable=SC2086
    setup_venv optimum $OPTIMUM_PINS || { record optimum "not installable here" "$LOGS/optimum.install.log"; return; }
    if [ ! -f "$model/model.onnx" ]; then
        step "export optimum model" "$LOGS/optimum.export.log" "$venv/bin/optimum-cli" export onnx -m "$CKPT" \
            --task text-generation-with-past --dtype fp32 "$model" \
            || { record optimum failed "$LOGS/optimum.export.log" --exit-status "$?"; return; }
    fi
    run_engine optimum "$venv/bin/python" --model "$model"
}

peer_llamacpp() {
    local venv=$PEER_ENVS/llamacpp stem=$PEER_ENVS/gguf/$NAME
    if [ ! -d "$LLAMACPP_SRC" ]; then  # the sdist: convert_hf_to_gguf.py and gguf-py of the same llama.cpp
        step "download llama-cpp-python sdist" "$LOGS/llamacpp.download.log" "$PY" -m pip download --no-deps \
            --no-binary :all: "llama-cpp-python==$LLAMACPP_VERSION" -d "$PEER_ENVS/sdist" \
            || { record llamacpp "not installable here" "$LOGS/llamacpp.download.log"; return; }
        mkdir -p "$PEER_ENVS/src"
        tar -xzf "$PEER_ENVS/sdist/llama_cpp_python-$LLAMACPP_VERSION.tar.gz" -C "$PEER_ENVS/src"
    fi
    # shellcheck disable=SC2086
    setup_venv llamacpp --cmake-args "$LLAMACPP_CMAKE_ARGS" $LLAMACPP_PINS \
        || { record llamacpp "not installable here" "$LOGS/llamacpp.install.log"; return; }
    # shellcheck disable=SC2086
    setup_venv gguf-convert $GGUF_PINS || { record llamacpp "not installable here" "$LOGS/gguf-convert.install.log"; return; }
    mkdir -p "$PEER_ENVS/gguf"
    for type in f32 q8_0; do
        [ -f "$stem.$type.gguf" ] || step "convert gguf $type" "$LOGS/gguf-$type.log" "$PEER_ENVS/gguf-convert/bin/python" \
            "$LLAMACPP_SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$CKPT" --outtype "$type" --outfile "$stem.$type.gguf" \
            || true  # a missing file becomes a failed row of that variant
    done
    for type in q4_0 q4_1; do  # llama.cpp's quantizer (llama_model_quantize) on the F32 GGUF
        [ -f "$stem.$type.gguf" ] || [ ! -f "$stem.f32.gguf" ] || step "quantize gguf $type" "$LOGS/gguf-$type.log" \
            "$venv/bin/python" bench/peers.py quantize-gguf --type "$type" --input "$stem.f32.gguf" \
            --out "$stem.$type.gguf" || true  # likewise; no F32 file: no step, a failed row
    done
    run_engine llamacpp "$venv/bin/python" --model "$stem"
}

# ---- project side: venv, bundle, prompts, the shared checkpoint
[ -x "$PY" ] || bash scripts/setup.sh
BASE_PYTHON=$("$PY" -c 'import sys; print(sys._base_executable)')
if [ ! -f "$BUNDLE/mars_config.json" ]; then
    step "export bundle" "$LOGS/bundle.export.log" .venv/bin/mars-export "$MODEL" --block 4 -o "$BUNDLE"
fi
"$PY" bench/peers.py prompts --work "$WORK" --bundle "$BUNDLE" "$@"
needs_checkpoint=false  # every peer reads the HF checkpoint; ENGINES=ours alone (the CI smoke run) needs none
for engine in "${ENGINE_LIST[@]}"; do [ "$engine" = ours ] || needs_checkpoint=true; done
if $needs_checkpoint && [ ! -f "$CKPT/config.json" ]; then
    mkdir -p "$(dirname "$CKPT")"
    step "write checkpoint" "$LOGS/checkpoint.log" "$PY" bench/peers.py checkpoint --model "$MODEL" --out "$CKPT"
fi

# ---- engines, one process each
run_engines() {  # run_engines ENGINE...: each engine in its own process, in this order
    local engine dtype
    for engine in "$@"; do
        case $engine in
            ours) run_engine ours "$PY" --model "$BUNDLE"
                  for dtype in $QUANTIZED; do ours_variant "$dtype" "--$dtype"; done
                  for dtype in $FUSED; do
                      if [ "$dtype" = float32 ]; then ours_variant fused --graph fused
                      else ours_variant "fused$dtype" --graph fused "--$dtype"; fi  # tags: [a-z0-9]+
                  done ;;
            transformers) run_engine transformers "$PY" --model "$CKPT" ;;
            ortgenai) peer_ortgenai ;;
            optimum) peer_optimum ;;
            llamacpp) peer_llamacpp ;;
        esac
    done
}

if [ "$ROUNDS" -eq 1 ]; then
    run_engines "${ENGINE_LIST[@]}"
    "$PY" bench/peers.py report --work "$WORK" --out "$OUT"
    exit 0
fi
reversed=()
for engine in "${ENGINE_LIST[@]}"; do reversed=("$engine" "${reversed[@]}"); done
rounds=()
for round in $(seq "$ROUNDS"); do
    order=("${ENGINE_LIST[@]}")
    [ $((round % 2)) -eq 1 ] || order=("${reversed[@]}")
    echo "== round $round of $ROUNDS: ${order[*]}"
    RUN_LOG_TAG=.round$round
    run_engines "${order[@]}"
    "$PY" bench/peers.py report --work "$WORK" --out "$OUT/round$round"
    rounds+=("$OUT/round$round")
done
# --force: an earlier summary in $OUT is replaced, as its rounds' reports were
"$PY" bench/peers_runs.py "${rounds[@]}" --out "$OUT" --name peers_runs --force
