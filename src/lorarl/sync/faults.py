"""`trainer.sync_fault`: a test switch that corrupts the adapter export before it is sent.

Off by default (null) and never for training: each fault is one of the export bugs LoRA-to-vLLM
sync code has shipped, so a run can show that the sync checks stop it at the first sync, naming
the place. They act on the payload as sent (PEFT names; experts in PEFT's stacks, or per expert
from Megatron), after the export and before the rollout loads it, except `trainer_scaling`, which
changes the trainer's own scaling of one module after the adapter was made (a fault no check was
written around).
In merged mode (`model.lora.merge=true`) the same faults act on the merged weights instead
(lorarl.sync.faults_merged).

    gate_up_swap    gate_proj and up_proj exchanged in every MLP (dense and each expert)
    expert_swap     experts 0 and 1 exchanged in the first MoE layer
    scale_x2        the scaling vLLM applies doubled (lora_alpha x 2 in the adapter config)
    scale_half      the scaling vLLM applies halved
    transpose       A and B sent transposed in every module where the shapes allow (in == out)
    missing_module  one module's A and B left out (the first layer's v_proj, or the first module)
    stale_layer     the last layer's tensors kept from the previous sync (zeros at the first)
    base_as_lora    base weights sent as LoRA tensors (the original seed bug)
    qk_swap         q_proj and k_proj exchanged in the first layer (A always, B where shapes match)
    trainer_scaling the trainer's scaling of its first LoRA module x 1.5 after the adapter is made

Two faults act on the send between processes instead, so they need trainer.placement=split (the
trainer's expected side of the checks still arrives, as a lost transfer would leave it):

    drop_send       the adapter never reaches the rollout workers
    stale_send      only the first sync's adapter does: the rollout keeps serving it
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from lorarl.config.schema import FAULTS, SEND_FAULTS  # the names; what each does is above
from lorarl.contract.payload import WeightPayload
from lorarl.errors import ConfigError
from lorarl.sync.faults_merged import corrupt_merged

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class SyncFault:
    """The chosen fault, with what it keeps between syncs (stale_layer's previous tensors)."""

    def __init__(self, name: str | None):
        if name is not None and name not in FAULTS + SEND_FAULTS:
            raise ConfigError(
                f"trainer.sync_fault={name!r} is not a fault; use null or one of: {', '.join(FAULTS + SEND_FAULTS)}"
            )
        self.name = name
        self._previous: dict[str, Tensor] = {}

    def drops_send(self, synced_before: bool) -> bool:
        """Whether this adapter is kept from the rollout workers (split placement); `synced_before`:
        an adapter (not the first sync's self-test) was sent already."""
        return self.name == "drop_send" or (self.name == "stale_send" and synced_before)

    def on_engine(self, engine) -> None:
        """Faults in the trainer itself, applied once after the engine is made."""
        if self.name == "trainer_scaling":
            name = getattr(engine, "adapter_name", "default")  # one adapter of several (AdapterView)
            for module in engine.model.modules():
                scaling = getattr(module, "scaling", None)
                if isinstance(scaling, dict) and name in scaling:
                    scaling[name] *= 1.5
                    return

    def corrupt(self, payload: WeightPayload, engine) -> WeightPayload:
        """The adapter payload as the fault would have exported it (unchanged when off)."""
        if self.name in (None, "trainer_scaling", *SEND_FAULTS):
            return payload
        tensors = dict(payload.tensors)
        config = dict(payload.adapter_config)
        if self.name == "base_as_lora":
            # The trainer's frozen weights under their PEFT names, beside the adapter: the payload
            # refuses them, naming the first.
            base = [(n, p) for n, p in engine.model.named_parameters() if not p.requires_grad][:2]
            return WeightPayload.adapter(dict(base) | tensors, config, payload.experts)
        if self.name in ("scale_x2", "scale_half"):
            factor = 2.0 if self.name == "scale_x2" else 0.5
            config["lora_alpha"] = config["lora_alpha"] * factor
            config["alpha_pattern"] = {k: v * factor for k, v in (config.get("alpha_pattern") or {}).items()}
        elif self.name in ("gate_up_swap", "expert_swap"):
            getattr(self, f"_{self.name}")(tensors, payload.experts)
        else:
            getattr(self, f"_{self.name}")(tensors)
        return WeightPayload.adapter(tensors, config, payload.experts)

    def corrupt_merged(self, payload: WeightPayload, engine) -> WeightPayload:
        """The merged (base-kind) payload as the fault would have exported it (unchanged when off)."""
        if self.name in (None, "trainer_scaling", *SEND_FAULTS):
            return payload
        return WeightPayload.base(corrupt_merged(self.name, dict(payload.tensors), engine, self._previous))

    # Each changes the name -> tensor dict in place.

    def _gate_up_swap(self, tensors: dict[str, Tensor], experts: dict) -> None:
        # A stacked gate_up B holds gate's rows, then up's (lorarl.sync.experts): swap the halves.
        stacks = [f"{m}.lora_B.weight" for m, w in experts.items() if w.parameter == "gate_up_proj"]
        for name in stacks:
            b = tensors[name]
            tensors[name] = torch.cat([b[b.shape[0] // 2 :], b[: b.shape[0] // 2]])
        if not stacks or any(".gate_proj." in n for n in tensors):
            _swap_where(tensors, ".gate_proj.", ".up_proj.", "an MLP with gate_proj and up_proj")

    def _qk_swap(self, tensors: dict[str, Tensor]) -> None:
        layer = ".layers.0."
        names = [n for n in tensors if layer in n and ".q_proj." in n]
        if not names:
            raise ConfigError("trainer.sync_fault=qk_swap needs LoRA on q_proj and k_proj of layer 0")
        for q in names:
            k = q.replace(".q_proj.", ".k_proj.")
            if k in tensors and (q.endswith("lora_A.weight") or tensors[q].shape == tensors[k].shape):
                tensors[q], tensors[k] = tensors[k], tensors[q]

    def _expert_swap(self, tensors: dict[str, Tensor], experts: dict) -> None:
        first = min((int(m[1]) for n in tensors if ".experts." in n and (m := _LAYER.search(n))), default=None)
        if first is None:
            raise ConfigError("trainer.sync_fault=expert_swap needs expert LoRA (model.lora.target_parameters)")
        layer = f".layers.{first}."
        for module, wrapper in experts.items():
            if layer not in module:
                continue
            # Stacked: A's rows run expert-major, B's columns expert-minor (lorarl.sync.experts).
            e, a_name, b_name = wrapper.num_experts, f"{module}.lora_A.weight", f"{module}.lora_B.weight"
            a = tensors[a_name].reshape(e, -1, tensors[a_name].shape[1]).clone()
            b = tensors[b_name].reshape(tensors[b_name].shape[0], -1, e).clone()
            a[[0, 1]], b[:, :, [0, 1]] = a[[1, 0]], b[:, :, [1, 0]]
            tensors[a_name], tensors[b_name] = a.reshape(tensors[a_name].shape), b.reshape(tensors[b_name].shape)
        zero = [n for n in tensors if layer in n and ".experts.0." in n]
        for n in zero:
            other = n.replace(".experts.0.", ".experts.1.")
            tensors[n], tensors[other] = tensors[other], tensors[n]

    def _transpose(self, tensors: dict[str, Tensor]) -> None:
        done = 0
        for a_name in [n for n in tensors if n.endswith("lora_A.weight")]:
            b_name = a_name[: -len("lora_A.weight")] + "lora_B.weight"
            a, b = tensors[a_name], tensors[b_name]
            if a.shape[1] == b.shape[0]:
                tensors[a_name], tensors[b_name] = b.T.contiguous(), a.T.contiguous()
                done += 1
        if not done:
            raise ConfigError("trainer.sync_fault=transpose needs a LoRA module whose in and out sizes are equal")

    def _missing_module(self, tensors: dict[str, Tensor]) -> None:
        stems = [n[: -len(".lora_A.weight")] for n in tensors if n.endswith(".lora_A.weight")]
        stem = next((s for s in stems if ".layers.0." in s and s.endswith("v_proj")), stems[0])
        del tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]

    def _stale_layer(self, tensors: dict[str, Tensor]) -> None:
        last = max(int(m[1]) for n in tensors if (m := _LAYER.search(n)))
        layer = f".layers.{last}."
        current = {n: t.clone() for n, t in tensors.items() if layer in n}
        for n in current:
            tensors[n] = self._previous.get(n, torch.zeros_like(current[n]))
        self._previous = current


def _swap_where(tensors: dict[str, Tensor], one: str, other: str, what: str) -> None:
    names = [n for n in tensors if one in n and n.replace(one, other) in tensors]
    if not names:
        raise ConfigError(f"trainer.sync_fault needs {what} in the adapter")
    for n in names:
        m = n.replace(one, other)
        tensors[n], tensors[m] = tensors[m], tensors[n]
