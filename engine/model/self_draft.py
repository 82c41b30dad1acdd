"""`--draft self`: the target itself, with 4-bit copies of its decoder layers, as the draft (SubSpec).

    draft = build_self_draft(target_runner, target_model, device)                  # RTN copies made at load
    draft = build_self_draft(target_runner, target_model, device, checkpoint_layers)  # a 4-bit checkpoint's

Which layers are copied: every layer of a resident target; of a streamed one, the streamed layers
only. The layers a streamed target keeps resident are shared with the draft as they are, and so are
the embeddings, final norm, rotary tables and head: the same tensors, counted once
(memory_plan.loaded_bytes). A copy's linear maps are 4-bit (engine.model.self_draft_quant), its
other tensors (norms, biases) its own, on the device; a map the kernel cannot take keeps the
target's precision (logged). The copies are made on the compute device from one pass over the
target's layers through its own layer source (a streamed layer is read from its ring slot there),
or taken from a 4-bit checkpoint of the same model (`--self-draft-from`).

The draft has its own config object, and every module of it that held the target's config holds
the draft's: a pass names the engine's attention on its runner's config for its length
(hf_attention.engine_attention), and with overlap the draft's passes run while the target's runs in
another thread, so the two must never share that field. Modules are cloned shallowly (their own
module tree and tensor dicts, the same tensors): the streamer rebinds only the target's modules.
The draft keeps its own KV cache (docs/design.md, "The self-draft").
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from engine.config import SELF_DRAFT
from engine.model.gptq_int4 import Int4Linear
from engine.model.runner import DecoderRunner
from engine.model.self_draft_quant import quantize_linear, refusal
from engine.offload.ring import LayerStreamer
from engine.types import ConfigError

log = logging.getLogger("specexec.engine")

SELF = SELF_DRAFT  # model.draft naming the self-draft


def copied_layers(target: DecoderRunner) -> list[int]:
    """Indices of the target layers the draft holds 4-bit copies of: the streamed ones, or all."""
    if isinstance(target.layers, LayerStreamer):
        return list(target.layers.streamed)
    return list(range(len(target.hf_layers)))


def clone_module(module: nn.Module, config_from: object, config_to: object) -> nn.Module:
    """A shallow copy of `module`'s tree: new module objects with their own dicts (parameters,
    buffers, children, hooks) holding the same tensors; attributes that were `config_from` are
    `config_to`."""
    clone = copy.copy(module)
    for name, value in vars(clone).items():
        if value is config_from:
            clone.__dict__[name] = config_to
        elif isinstance(value, dict | set):
            clone.__dict__[name] = copy.copy(value)
    clone._modules = {name: None if child is None else clone_module(child, config_from, config_to)
                      for name, child in module._modules.items()}
    return clone


def check_copyable(layer: nn.Module, idx: int) -> None:
    """Refuse a layer whose weights are not in linear maps (fused MoE experts, convolutions)."""
    for name, sub in layer.named_modules():
        if isinstance(sub, nn.Linear | Int4Linear):
            continue
        for leaf, param in sub._parameters.items():
            if param is not None and param.dim() >= 2:
                where = f"{name}.{leaf}" if name else leaf
                raise ConfigError("model.draft", f"--draft self: decoder layer {idx} keeps weights outside linear "
                                  f"maps ({where}, {tuple(param.shape)}), which the self-draft does not quantize")


def own_tensors(module: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of `module` (a clone) outside its Int4Linear maps a copy of its
    own on `device` (a streamed layer's tensors are ring slot views, reused by the next layer)."""
    for sub in module.modules():
        if isinstance(sub, Int4Linear):
            continue
        for leaf, param in sub._parameters.items():
            if param is not None:
                sub._parameters[leaf] = nn.Parameter(param.detach().to(device, copy=True), requires_grad=False)
        for leaf, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[leaf] = buf.to(device, copy=True)


def quantized_copy(layer: nn.Module, idx: int, config_from: object, config_to: object,
                   device: torch.device) -> tuple[nn.Module, list[str]]:
    """The 4-bit copy of decoder layer `idx` (its tensors readable now: resident, or bound to a ring
    slot) on `device`, and the names of the linear maps kept at the target's precision."""
    check_copyable(layer, idx)
    clone = clone_module(layer, config_from, config_to)
    kept = []
    for name, sub in list(clone.named_modules()):
        if not isinstance(sub, nn.Linear):
            continue
        why = refusal(sub.in_features, sub.out_features, device)
        if why is not None:
            kept.append(f"layer {idx} {name} ({why})")
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = clone.get_submodule(owner_name) if owner_name else clone
        setattr(owner, leaf, quantize_linear(sub.weight, sub.bias, device))
    own_tensors(clone, device)
    return clone, kept


def adopted_layer(layer: nn.Module, idx: int, target: DecoderRunner, config_to: object, device: torch.device) -> nn.Module:
    """Layer `idx` of a 4-bit checkpoint of the target, rewired to the draft's config, on `device`."""
    source = getattr(layer.self_attn, "config", None)
    want = {name: tuple(t.shape) for name, t in target.hf_layers[idx].named_parameters() if t.dim() == 1}
    have = {name: tuple(t.shape) for name, t in layer.named_parameters() if t.dim() == 1}
    if any(have.get(name) != shape for name, shape in want.items()):
        raise ConfigError("model.self_draft_from", f"its decoder layer {idx} does not have the target's shapes")
    return clone_module(layer.to(device), source, config_to)


def draft_config_of(target: DecoderRunner) -> object:
    """The draft's own config: a copy of the target's (the same model, another object)."""
    return copy.deepcopy(target.config)


def build_self_draft(target: DecoderRunner, target_model: nn.Module, device: torch.device,
                     checkpoint_layers: list[nn.Module] | None = None) -> DecoderRunner:
    """The self-draft of a loaded target (module doc): 4-bit copies of `copied_layers(target)`, made
    from the target's weights, or taken from `checkpoint_layers` (a 4-bit checkpoint's decoder
    layers, all of them); the target's other layers, embeddings, norm, rotary tables and head shared."""
    config_from, config_to = target.config, draft_config_of(target)
    if checkpoint_layers is not None and len(checkpoint_layers) != len(target.hf_layers):
        raise ConfigError("model.self_draft_from", f"{len(checkpoint_layers)} decoder layers, the target has "
                          f"{len(target.hf_layers)}: not a checkpoint of the same model")
    copied = set(copied_layers(target))
    layers: list[nn.Module] = []
    kept: list[str] = []
    if checkpoint_layers is None:
        target.layers.begin_pass()  # one pass through the target's own layer source, in pass order
        for idx in range(target.layers.num_layers):
            with target.layers.layer(idx) as layer:
                if idx in copied:
                    layer, missed = quantized_copy(layer, idx, config_from, config_to, device)
                    kept += missed
                    layers.append(layer)
                else:
                    layers.append(clone_module(layer, config_from, config_to))
    else:
        for idx, layer in enumerate(target.hf_layers):
            if idx in copied:
                layers.append(adopted_layer(checkpoint_layers[idx], idx, target, config_to, device))
            else:
                layers.append(clone_module(layer, config_from, config_to))
    if kept:
        log.warning("--draft self: %d linear maps keep the target's precision (%s)", len(kept), "; ".join(kept[:3]))
    runner = DecoderRunner(draft_model(target_model, layers, config_from, config_to))
    runner.attention_backends = target.attention_backends
    nbytes = sum(t.numel() * t.element_size() for idx in copied for t in [*layers[idx].parameters(), *layers[idx].buffers()])
    log.info("--draft self: 4-bit copies of %d layers (%.3f GB on %s, %s); shared with the target: its embeddings, "
             "final norm, head, rotary tables and %d resident layers", len(copied), nbytes / 1e9, device,
             "quantized at load" if checkpoint_layers is None else "from --self-draft-from", len(layers) - len(copied))
    return runner


def draft_model(target_model: nn.Module, layers: list[nn.Module], config_from: object, config_to: object) -> nn.Module:
    """The target's CausalLM object, shallowly copied around `layers`: its embeddings, norm, rotary
    module and head the same modules; config attributes the draft's."""
    base = copy.copy(target_model.model)
    base.__dict__.update({k: copy.copy(v) for k, v in vars(base).items() if isinstance(v, dict | set)})
    base._modules["layers"] = nn.ModuleList(layers)
    model = copy.copy(target_model)
    model.__dict__.update({k: copy.copy(v) for k, v in vars(model).items() if isinstance(v, dict | set)})
    model._modules["model"] = base
    for module in (base, model):
        for name, value in vars(module).items():
            if value is config_from:
                module.__dict__[name] = config_to
    return model
