"""Simulated Megatron ranks of a real HF checkpoint with LoRA, for CPU tests of the Megatron
engine's sync-check sides (megatron-core's forward needs CUDA, Megatron-Bridge Python 3.12).

Each simulated rank gets the model chunk MegatronEngine would hold after Megatron-Bridge loaded the
checkpoint and wrapped its linears with LoRA, as real torch modules and tensors: the base weights in
Megatron's fused layout (tests/megatron_reference.py, tests/megatron_moe_reference.py: linear_qkv
interleaved per query group, linear_fc1 [gate_t; up_t] per tensor-parallel rank), column-parallel
linears split on their rows and row-parallel ones on their input columns, under the wrapper's
`<linear>.to_wrap.weight`; the fused (or CanonicalLoRA) adapters `adapter[.adapter_x].linear_in|
linear_out.weight` with alpha and dim on the adapter module, A split on the rank dim (column-parallel
bases) or input (row-parallel), B on its rows; a routed expert's linears whole on the
expert-parallel rank that holds it, numbered locally; pipeline stages holding consecutive layers,
numbered locally with each TransformerLayer's global `layer_number`, under DDP's `module.` prefix.

`SimulatedMegatron` then runs lorarl's own code on every rank (model_bases / model_lora, the shares)
and sums the shares as MegatronEngine's all-reduces sum them: dense ones over the tensor-parallel
group, experts over the expert-parallel group; pipeline stages are joined as its all_gather_object
joins them. It also answers what the merged sync faults ask of the engine (the unmerged base, the
LoRA tensors under PEFT names), from the checkpoint and the factors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from lorarl.engines.megatron.base_projections import finish_base, megatron_base_shares, model_bases
from lorarl.engines.megatron.projections import finish, megatron_shares, model_lora, shape_from_config
from lorarl.sync.semantic_merged import BaseProjections
from tests import megatron_moe_reference as M
from tests import megatron_reference as R

RANK, ALPHA = 8, 16.0
SCALING = ALPHA / RANK
# The merged self-test's factor size (lorarl.sync.session): a delta of the weights' own size at rank 8.
FACTOR_STD = 0.05
# CanonicalLoRA targets of the canonical cases: q, v, o, up (k, gate, down stay without LoRA; so
# does linear_fc2, which is then not wrapped at all).
CANONICAL = {"linear_qkv": ("adapter_q", "adapter_v"), "linear_proj": None, "linear_fc1": ("adapter_up",)}
_SUB_PROJ = {"adapter_q": "q_proj", "adapter_k": "k_proj", "adapter_v": "v_proj", "adapter_up": "up_proj"}
_COLUMN, _ROW = ("linear_qkv", "linear_fc1"), ("linear_proj", "linear_fc2")


@dataclass(frozen=True)
class Case:
    model: str  # qwen2_tiny | qwen3_moe_tiny
    tp: int = 1
    ep: int = 1
    pp: int = 1
    dtype: str = "float32"
    lora: str = "lora"  # lora (fused) | canonical_lora

    @property
    def id(self) -> str:
        parts = [self.model, f"tp{self.tp}", f"ep{self.ep}", f"pp{self.pp}", self.dtype]
        return "-".join(parts + (["canonical"] if self.lora != "lora" else []))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Checkpoint:
    config: object  # transformers config
    tensors: dict[str, Tensor]  # HF names, as on disk (experts per expert)

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        from transformers import AutoConfig

        tensors = {}
        for f in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        return cls(AutoConfig.from_pretrained(str(path)), tensors)

    @property
    def experts(self) -> int:
        return int(getattr(self.config, "num_experts", None) or 0)

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def attention(self) -> R.AttentionShape:
        return R.AttentionShape.from_hf_config(json.loads(self.config.to_json_string()))


def make_factors(ck: Checkpoint, case: Case, seed: int = 0) -> dict[str, tuple[Tensor, Tensor]]:
    """Per HF module path carrying LoRA, (A [r, in], B [out, r]) in the case's dtype; the
    projections one fused Megatron adapter covers share its A (q/k/v; gate/up)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return (torch.randn(*shape, generator=gen) * FACTOR_STD).to(case.torch_dtype)

    def dims(path: str) -> tuple[int, int]:
        return tuple(ck.tensors[f"{path}.weight"].shape)

    out: dict[str, tuple[Tensor, Tensor]] = {}

    def fused(paths: list[str]) -> None:
        a = rnd(RANK, dims(paths[0])[1])
        out.update({p: (a, rnd(dims(p)[0], RANK)) for p in paths})

    for layer in range(ck.layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        if case.lora == "lora":
            fused([f"{attn}.{p}" for p in ("q_proj", "k_proj", "v_proj")])
            fused([f"{attn}.o_proj"])
            stems = [f"{mlp}.experts.{e}" for e in range(ck.experts)] or [mlp]
            for stem in stems:
                fused([f"{stem}.gate_proj", f"{stem}.up_proj"])
                fused([f"{stem}.down_proj"])
        else:
            for p in (f"{attn}.q_proj", f"{attn}.v_proj", f"{attn}.o_proj", f"{mlp}.up_proj"):
                fused([p])
    return out


def _megatron_state(ck: Checkpoint, case: Case) -> dict[str, Tensor]:
    """The whole (gathered) Megatron state of the checkpoint, global layer and expert numbers."""
    hf = {k: v.to(case.torch_dtype) for k, v in ck.tensors.items()}
    if ck.experts:
        return M.hf_to_megatron_state(hf, ck.attention)
    return R.hf_to_megatron_state(hf, ck.attention, spec="local", tp_size=case.tp)


def _wrapped(case: Case) -> dict[str, tuple[str, ...] | None]:
    """Megatron linears LoRA wraps -> their CanonicalLoRA sub-adapters (None: one fused adapter)."""
    if case.lora != "lora":
        return dict(CANONICAL)
    return {"linear_qkv": None, "linear_proj": None, "linear_fc1": None, "linear_fc2": None}


def _adapter_factors(ck: Checkpoint, f, layer: int, linear: str, expert: int | None, tp: int) -> tuple[Tensor, Tensor]:
    """The fused adapter's whole (A, B) of one Megatron linear, B in the base weight's row layout."""
    stem = f"model.layers.{layer}.mlp" + (f".experts.{expert}" if expert is not None else "")
    attn = f"model.layers.{layer}.self_attn"
    if linear == "linear_qkv":
        q, k, v = (f[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj"))
        return q[0], R.merge_qkv(q[1], k[1], v[1], ck.attention)
    if linear == "linear_proj":
        return f[f"{attn}.o_proj"]
    if linear == "linear_fc1":
        (a, gate), (_, up) = f[f"{stem}.gate_proj"], f[f"{stem}.up_proj"]
        return a, R.merge_gate_up(gate, up, 1 if expert is not None else tp)
    return f[f"{stem}.down_proj"]


_LINEAR = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\.(?P<parent>self_attention|mlp)"
    r"(?:\.experts\.local_experts\.(?P<expert>\d+))?\.(?P<linear>linear_\w+)\.(?P<leaf>weight|bias)$"
)


def rank_chunk(
    ck: Checkpoint, state: dict[str, Tensor], f, case: Case, tp_rank: int, ep_rank: int, stage: int
) -> nn.Module:
    """The model chunk of one simulated rank, as real modules holding real tensors; `state` is the
    whole Megatron state (`_megatron_state`), `f` the factors per HF module."""
    per_stage, local_experts = ck.layers // case.pp, max(ck.experts, 1) // case.ep
    first, wrapped = stage * per_stage, _wrapped(case)
    params: dict[str, Tensor] = {}
    scaled: list[str] = []

    def shard(t: Tensor, dim: int) -> Tensor:
        return t.chunk(case.tp, dim)[tp_rank].clone()

    for name, t in state.items():
        in_layer = re.match(r"^decoder\.layers\.(\d+)\.", name)
        if in_layer is None:  # embeddings on the first stage, the final norm and head on the last
            if stage == (0 if name.startswith("embedding.") else case.pp - 1):
                params[name] = shard(t, 0) if "word_embeddings" in name or "output_layer" in name else t.clone()
            continue
        layer, m = int(in_layer[1]), _LINEAR.match(name)
        if not first <= layer < first + per_stage:
            continue
        local_name = name.replace(f"decoder.layers.{layer}.", f"decoder.layers.{layer - first}.", 1)
        if m is None:
            params[local_name] = t.clone()
            continue
        expert = None if m["expert"] is None else int(m["expert"])
        if expert is not None:
            if expert // local_experts != ep_rank:
                continue
            local_name = local_name.replace(f"local_experts.{expert}.", f"local_experts.{expert % local_experts}.")
        linear = m["linear"]
        part = t.clone() if expert is not None else shard(t, 0 if linear in _COLUMN or m["leaf"] == "bias" else 1)
        if linear not in wrapped:
            params[local_name] = part
            continue
        prefix = local_name.rsplit(".", 1)[0]
        params[f"{prefix}.to_wrap.{m['leaf']}"] = part
        if m["leaf"] == "bias":
            continue
        for sub, a, b in _adapters(ck, f, layer, linear, expert, wrapped[linear], case.tp):
            split = expert is None  # experts: expert tensor parallelism 1
            adapter = f"{prefix}.adapter" + (f".{sub}" if sub else "")
            params[f"{adapter}.linear_in.weight"] = shard(a, 1 if linear in _ROW and not sub else 0) if split else a
            params[f"{adapter}.linear_out.weight"] = shard(b, 0) if split else b
            scaled.append(adapter)
    layer_numbers = {local: first + local + 1 for local in range(per_stage)}
    return module_tree({f"module.{n}": t for n, t in params.items()}, layer_numbers, [f"module.{a}" for a in scaled])


def _adapters(ck: Checkpoint, f, layer: int, linear: str, expert: int | None, subs, tp: int):
    """[(sub-adapter or None, whole A, whole B)] of one wrapped linear."""
    if subs is None:
        return [(None, *_adapter_factors(ck, f, layer, linear, expert, tp))]
    parent = "self_attn" if linear == "linear_qkv" else "mlp"
    return [(sub, *f[f"model.layers.{layer}.{parent}.{_SUB_PROJ[sub]}"]) for sub in subs]


def module_tree(params: dict[str, Tensor], layer_numbers: dict[int, int], adapters: list[str]) -> nn.Module:
    """nn.Modules named as `params` say, holding them as parameters (LoRA ones trainable); each
    `decoder.layers.<local>` a TransformerLayer-like module with its 1-based global `layer_number`,
    each adapter module with Megatron-Bridge's `alpha` and `dim`."""
    root = nn.Module()

    def module_at(path: list[str]) -> nn.Module:
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        return m

    for name, t in params.items():
        *path, leaf = name.split(".")
        module_at(path).register_parameter(leaf, nn.Parameter(t, requires_grad=".adapter." in name))
    for local, number in layer_numbers.items():
        module_at(f"module.decoder.layers.{local}".split(".")).layer_number = number
    for name in adapters:
        adapter = module_at(name.split("."))
        adapter.alpha, adapter.dim = ALPHA, RANK
    return root


class SimulatedParallelState:
    """The parallel_state getters lorarl's shape_from_config reads, for one simulated rank."""

    def __init__(self, tp_rank: int, tp: int, ep_rank: int, ep: int):
        self.tp_rank, self.tp, self.ep_rank, self.ep = tp_rank, tp, ep_rank, ep

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_expert_model_parallel_rank(self) -> int:
        return self.ep_rank

    def get_expert_model_parallel_world_size(self) -> int:
        return self.ep


class SimulatedMegatron:
    """MegatronEngine's sync-check methods over the simulated ranks of `case` (see the module).
    The factors never change here, so each side is computed once and kept."""

    def __init__(self, ck: Checkpoint, factors: dict[str, tuple[Tensor, Tensor]], case: Case):
        self.ck, self.factors, self.case = ck, factors, case
        self.world = max(case.tp, case.ep)  # rank i: tensor-parallel rank i % tp, expert-parallel i % ep
        self._state = _megatron_state(ck, case)
        self._base: BaseProjections | None = None
        self._delta: dict | None = None

    def _stages(self, shares_of, finish_dense, finish_experts) -> dict:
        out: dict = {}
        for stage in range(self.case.pp):
            shares = [shares_of(self._chunk(i, stage), self._shape(i)) for i in range(self.world)]
            dense = sum(s.dense_flat for s in shares[: self.case.tp])
            experts = sum(s.experts_flat for s in shares[: self.case.ep])
            mine = {**finish_dense(shares[0], dense), **finish_experts(shares[0], experts)}
            assert not set(mine) & set(out), "two pipeline stages hold one module"
            out.update(mine)
        return out

    def _chunk(self, i: int, stage: int) -> nn.Module:
        return rank_chunk(self.ck, self._state, self.factors, self.case, i % self.case.tp, i % self.case.ep, stage)

    def _shape(self, i: int):
        ps = SimulatedParallelState(i % self.case.tp, self.case.tp, i % self.case.ep, self.case.ep)
        return shape_from_config(self.ck.config, RANK, ps)

    def base_projections(self) -> BaseProjections:
        if self._base is None:
            self._base = self._base_projections()
        return self._base

    def lora_projections(self) -> dict:
        if self._delta is None:
            self._delta = self._stages(
                lambda chunk, shape: megatron_shares(*model_lora([chunk]), shape),
                lambda s, flat: finish(s.dense, flat, RANK),
                lambda s, flat: finish(s.experts, flat, RANK),
            )
        return self._delta

    def _base_projections(self) -> BaseProjections:
        roundoffs = set()

        def shares_of(chunk, shape):
            shares = megatron_base_shares(*model_bases([chunk]), shape)
            roundoffs.add(shares.roundoff)
            return shares

        modules = self._stages(
            shares_of, lambda s, flat: finish_base(s.dense, flat), lambda s, flat: finish_base(s.experts, flat)
        )
        (roundoff,) = roundoffs
        return BaseProjections(modules, roundoff)

    # What lorarl.sync.faults_merged asks of the engine, from the checkpoint and the factors.

    def base_stream(self, merge: bool):
        assert not merge, "the merged faults read the unmerged base"
        return ((n, t.to(self.case.torch_dtype)) for n, t in self.ck.tensors.items())

    def lora_state(self) -> dict[str, Tensor]:
        out = {}
        for path, (a, b) in self.factors.items():
            out[f"base_model.model.{path}.lora_A.weight"] = a
            out[f"base_model.model.{path}.lora_B.weight"] = b
        return out
