"""The run's config: one typed schema per YAML group under conf/, how they compose, how they are checked.

schema      one typed schema per config group: keys, types, docs, each group's own checks
algorithm   the algorithm group's schemas (rollout correction, dynamic sampling, overlong shaping)
backends    the backend group's schemas (FSDP2, Megatron)
run         RunConfig, the typed config the trainer gets, one field per group
validate    the checks that need several groups, and those against the model's shape
compose     conf/grpo.yaml -> RunConfig through Hydra; importing it registers the schemas with Hydra

The checks of the model itself and of the installed vLLM (config.json, vLLM's model registry and
engine arguments) are not here: they read files and ask vLLM, not the config, and live in
lorarl.driver.preflight.
"""
