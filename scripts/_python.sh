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
# data_dir_knob: DATA_DIR=/path -> train/test parquet files in that folder.
data_dir_knob() {
  if [[ -n "${DATA_DIR:-}" ]]; then
    KNOBS+=("data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$DATA_DIR/test.parquet]")
  fi
}
