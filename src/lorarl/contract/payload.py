"""The weight-sync payload: one type that carries its own kind.

The seed bug sent a full base state dict down the adapter path because the producer
and the consumer each kept their own "is the base synced" flag. Here the producer
picks the kind when it builds the payload, the payload checks that its contents
match that kind, and the rollout dispatches on it: there is no second flag to
disagree with, and a mismatched payload fails here, before vLLM sees it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

from torch import Tensor

from lorarl.errors import SyncError

# PEFT's saved form (get_peft_model_state_dict): adapter name removed, prefix kept.
_ADAPTER_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_REQUIRED_ADAPTER_KEYS = ("r", "lora_alpha", "target_modules")


@dataclass(frozen=True)
class ExpertWrapper:
    """One PEFT ParamWrapper over a stacked expert parameter (lorarl.sync.experts finds them in a
    model): what an adapter payload's routed experts are named by."""

    module: str  # PEFT module name as saved, e.g. base_model.model.model.layers.0.mlp.experts.base_layer
    parameter: str  # gate_up_proj | down_proj
    num_experts: int


class PayloadKind(str, Enum):
    BASE = "base"
    ADAPTER = "adapter"


@dataclass(frozen=True, eq=False)  # eq on tensors would compare element-wise
class WeightPayload:
    """Weights bound for the rollout engine.

    `BASE`: plain HF names and full tensors; `tensors` may be a one-shot stream and
    each name is checked as it is read. `ADAPTER`: PEFT names
    (`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`), materialised and
    checked at construction, plus the adapter config as a plain dict. An adapter's routed
    experts travel as PEFT trains them, one stacked A/B pair per fused expert parameter
    (lorarl.sync.experts), named in `experts` by PEFT module; an adapter without `experts` holds
    every expert's factors under its own per-expert name (the Megatron export).
    Build with `WeightPayload.base(...)` / `WeightPayload.adapter(...)`.
    """

    kind: PayloadKind
    tensors: Iterable[tuple[str, Tensor]]
    adapter_config: dict | None = field(default=None)
    experts: Mapping[str, ExpertWrapper] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Validation lives here, not in the constructors, so no payload can be built
        # around it.
        try:
            kind = PayloadKind(self.kind)
        except ValueError:
            raise SyncError(f"payload kind {self.kind!r} is neither 'base' nor 'adapter'") from None
        object.__setattr__(self, "kind", kind)
        if kind is PayloadKind.ADAPTER:
            tensors = _validate_adapter_tensors(self.tensors)
            config = _validate_adapter_config(self.adapter_config, tensors, self.experts)
            object.__setattr__(self, "tensors", tensors)
            object.__setattr__(self, "adapter_config", config)
            object.__setattr__(self, "experts", dict(self.experts))
        else:
            if self.experts:
                raise SyncError("base payload got expert stacks; only an adapter carries them")
            if self.adapter_config is not None:
                raise SyncError(
                    "base payload got an adapter_config; base weights carry none "
                    "(use WeightPayload.adapter for LoRA tensors)"
                )
            object.__setattr__(self, "tensors", _BaseStream(self.tensors))

    @classmethod
    def adapter(
        cls,
        tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        adapter_config: dict,
        experts: Mapping[str, ExpertWrapper] | None = None,
    ) -> WeightPayload:
        return cls(PayloadKind.ADAPTER, tensors, adapter_config, experts or {})

    @classmethod
    def base(cls, tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> WeightPayload:
        return cls(PayloadKind.BASE, tensors)

    @property
    def max_rank(self) -> int:
        """Largest LoRA rank in an adapter payload (r or any rank_pattern value)."""
        if self.adapter_config is None:
            raise SyncError("max_rank asked of a base payload; only adapters have a rank")
        return max([self.adapter_config["r"], *self.adapter_config.get("rank_pattern", {}).values()])


@dataclass
class SyncStats:
    """One payload's sync; a step's payloads sum into lorarl.contract.messages.SyncReport. gather_s is
    the producer's share (trainer side)."""

    kind: PayloadKind
    num_tensors: int = 0
    bytes: int = 0
    gather_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.gather_s + self.transfer_s + self.load_s


def _pairs(tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> Iterable:
    if isinstance(tensors, Mapping):
        return tensors.items()
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise SyncError(
            f"payload tensors must be a mapping or an iterable of (name, tensor), got {type(tensors).__name__}"
        )
    return tensors


def _check_pair(item: object, kind: PayloadKind) -> tuple[str, Tensor]:
    if not (isinstance(item, tuple) and len(item) == 2):
        raise SyncError(f"{kind.value} payload item must be a (name, tensor) pair, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str) or not isinstance(tensor, Tensor):
        raise SyncError(
            f"{kind.value} payload item must be (str, torch.Tensor), got ({type(name).__name__}, {type(tensor).__name__})"
        )
    return name, tensor


def _vllm_parse_lora_name():
    # vLLM's own parser: the adapter loader calls it on every name, so checking with
    # it here moves that failure to the producer, with a clearer message.
    from vllm.lora.utils import parse_fine_tuned_lora_name

    return parse_fine_tuned_lora_name


def _validate_adapter_tensors(tensors) -> tuple[tuple[str, Tensor], ...]:
    parse = _vllm_parse_lora_name()
    items: list[tuple[str, Tensor]] = []
    seen: dict[str, Tensor] = {}
    for item in _pairs(tensors):
        name, tensor = _check_pair(item, PayloadKind.ADAPTER)
        if name in seen:
            raise SyncError(f"adapter payload names tensor '{name}' twice")
        match = _ADAPTER_NAME.match(name)
        if match is None:
            if "lora_" not in name:
                raise SyncError(
                    f"adapter payload holds base weight '{name}' (vLLM would reject it as "
                    "'unsupported LoRA weight'); send base weights as WeightPayload.base(...)"
                )
            raise SyncError(
                f"adapter tensor '{name}' is not in PEFT saved form "
                "'base_model.model.<module>.lora_A.weight' / '.lora_B.weight' "
                "(take names from peft.get_peft_model_state_dict)"
            )
        try:
            parse(name)
        except ValueError as exc:
            raise SyncError(f"adapter tensor '{name}' is rejected by vLLM: {exc}") from None
        if tensor.dim() != 2:
            raise SyncError(f"adapter tensor '{name}' must be 2-D, got shape {tuple(tensor.shape)}")
        seen[name] = tensor
        items.append((name, tensor))
    if not items:
        raise SyncError("adapter payload is empty; an adapter needs lora_A/lora_B tensors")
    for name, tensor in items:
        match = _ADAPTER_NAME.match(name)
        assert match is not None
        if match["ab"] != "A":
            other = name[: -len("lora_B.weight")] + "lora_A.weight"
            if other not in seen:
                raise SyncError(f"adapter tensor '{name}' has no matching '{other}'")
            continue
        other = name[: -len("lora_A.weight")] + "lora_B.weight"
        if other not in seen:
            raise SyncError(f"adapter tensor '{name}' has no matching '{other}'")
        if tensor.shape[0] != seen[other].shape[1]:
            raise SyncError(
                f"adapter tensors '{name}' {tuple(tensor.shape)} and '{other}' "
                f"{tuple(seen[other].shape)} disagree on the rank"
            )
    return tuple(items)


def _validate_adapter_config(config, tensors: tuple[tuple[str, Tensor], ...], experts: Mapping) -> dict:
    if not isinstance(config, Mapping):
        raise SyncError(
            f"adapter payload needs adapter_config as a plain dict (peft: LoraConfig.to_dict()), "
            f"got {type(config).__name__}"
        )
    missing = [k for k in _REQUIRED_ADAPTER_KEYS if k not in config]
    if missing:
        raise SyncError(f"adapter_config lacks {', '.join(missing)}; it needs r, lora_alpha and target_modules")
    out = dict(config)
    r = out["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise SyncError(f"adapter_config r must be a positive integer, got {r!r}")
    targets = out["target_modules"]
    if isinstance(targets, (set, frozenset, tuple, list)):
        targets = sorted(targets)  # a set (as LoraConfig holds it) is not JSON
        if not targets:
            raise SyncError("adapter_config target_modules is empty; list the LoRA-wrapped modules")
    elif not isinstance(targets, str):
        raise SyncError(f"adapter_config target_modules must be a list or a regex string, got {type(targets).__name__}")
    out["target_modules"] = targets
    if out.get("bias", "none") != "none":
        raise SyncError(f"adapter_config bias={out['bias']!r}: vLLM serves only bias='none' adapters")
    out.setdefault("peft_type", "LORA")
    try:
        # The tmpfs transport writes adapter_config.json; fail here, not mid-sync.
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise SyncError(f"adapter_config must be JSON-serialisable (plain dict): {exc}") from None
    names = {name for name, _ in tensors}
    for module in experts:
        if f"{module}.lora_A.weight" not in names:
            raise SyncError(f"adapter payload names expert stack '{module}' but holds no '{module}.lora_A.weight'")
    if not out.get("rank_pattern"):
        for name, tensor in tensors:
            stack = experts.get(name[: -len(".lora_A.weight")])
            rows = r * (stack.num_experts if stack is not None else 1)
            if name.endswith("lora_A.weight") and tensor.shape[0] != rows:
                per = f" ({stack.num_experts} experts of rank r)" if stack is not None else ""
                raise SyncError(f"adapter tensor '{name}' has {tensor.shape[0]} rows but adapter_config r={r}{per}")
    return out


class _BaseStream:
    """Checks base names while they stream, so a base payload can be a generator."""

    def __init__(self, tensors) -> None:
        self._source = _pairs(tensors)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for item in self._source:
            name, tensor = _check_pair(item, PayloadKind.BASE)
            if "lora_" in name or name.startswith("base_model.model.") or ".base_layer" in name:
                raise SyncError(
                    f"base payload tensor '{name}' is not a plain HF name (no 'lora_', "
                    "'base_model.model.' or '.base_layer'); strip PEFT wrapping or merge first, "
                    "and send LoRA tensors as WeightPayload.adapter(...)"
                )
            yield name, tensor
