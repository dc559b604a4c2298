# Sourced by the launch scripts: the interpreter to use ($PYTHON, else ./.venv, else python3),
# and `knob`, which turns an environment variable into a Hydra override only when it is set,
# so an unset knob leaves the experiment preset's value in force (the script cannot drift).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
cd "$ROOT"

KNOBS=()
# knob VAR key [key...]: append key=$VAR for each key when $VAR is set and not empty.
knob() {
  local var="$1"
  shift
  if [[ -n "${!var:-}" ]]; then
    local key
    for key in "$@"; do KNOBS+=("$key=${!var}"); done
  fi
}
# need VAR what: stop with one line (exit 2) when $VAR is unset or empty; `what` says what it holds.
need() {
  if [[ -z "${!1:-}" ]]; then
    echo "error: $1 is not set: $2 (docs/gpu.md)" >&2
    exit 2
  fi
}
# model_path_knob: MODEL_PATH (required) -> model.path: a local model folder or a hub id.
model_path_knob() {
  need MODEL_PATH "the model to train, a local HF folder (config.json + *.safetensors) or a hub id such as $1"
  KNOBS+=("model.path=$MODEL_PATH")
}
# data_dir_knob: DATA_DIR (required) -> train/test parquet files in that folder.
data_dir_knob() {
  need DATA_DIR "the folder scripts/prepare_gsm8k.py --out-dir wrote train.parquet and test.parquet to"
  KNOBS+=("data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$DATA_DIR/test.parquet]")
}
