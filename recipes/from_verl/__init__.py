"""Translate a verl GRPO launch into the lorarl command that trains the same way.

python -m recipes.from_verl run_qwen2-7b_math_megatron_lora.sh
python -m recipes.from_verl --check run_dapo_qwen2.5_32b.sh
python -m recipes.from_verl actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct data.train_files=...
python -m recipes.from_verl --run run_qwen2-7b_math_megatron_lora.sh -- trainer.total_epochs=1

Modules: keys (the one table of verl keys, with ignored_keys.yaml), releases (the verl releases
whose trainer-config keys the table covers), defaults (verl's defaults and the deliberate
differences), launch (reading a launch script), reading (its arguments, as verl's Hydra reads
them), models (checkpoint name -> preset), translate, carry and reward_file (the translation),
errors (the problems, decisive first), check (`--check`), table (the README's table), cli.
"""

from recipes.from_verl.errors import VerlTranslationError
from recipes.from_verl.keys import VERL_KEYS, Key, verl_row
from recipes.from_verl.launch import Launch, script_launch
from recipes.from_verl.result import Translation
from recipes.from_verl.table import markdown_table
from recipes.from_verl.translate import translate

__all__ = [
    "VERL_KEYS",
    "Key",
    "Launch",
    "Translation",
    "VerlTranslationError",
    "markdown_table",
    "script_launch",
    "translate",
    "verl_row",
]
