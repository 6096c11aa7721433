"""What the ecosystem tests and ``benchmarks/models/bench_ecosystem.py`` both build: a random LoRA
on the blocks' projections and a GGUF checkpoint of a transformer's weights."""

from __future__ import annotations

import os

import torch

#: the projections a LoRA targets (Flux's, Wan's and the other image/video blocks' names)
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
                "ffn.net.0.proj", "ffn.net.2")


def in_blocks(name: str) -> bool:
    """Whether the module or weight ``name`` lies in one of the transformer's repeated blocks."""
    return name.startswith(("transformer_blocks.", "single_transformer_blocks.", "blocks."))


def lora_state_dict(tr, seed: int, rank: int) -> dict:
    """A random LoRA of ``rank`` (A and B both nonzero) on every attention and MLP projection of the
    blocks, on the model's device, in the format ``load_lora_adapter(..., prefix=None)`` reads."""
    device = next(tr.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for n, m in tr.named_modules():
        n = n.removesuffix(".base_layer")  # a layer with an adapter already: peft's wrapper holds it
        if isinstance(m, torch.nn.Linear) and ".lora_" not in n and in_blocks(n) and n.endswith(LORA_TARGETS):
            sd[f"{n}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g, device=device)
                                        * m.in_features ** -0.5).to(torch.bfloat16)
            sd[f"{n}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g, device=device)
                                        * 0.02).to(torch.bfloat16)
    assert sd, "no projection of the blocks to put a LoRA on"
    return sd


def write_gguf(tr, folder: str, kind, arch: str) -> str:
    """``tr``'s config and weights in ``folder`` (the blocks' 2-D weights whose rows fill whole blocks
    of the GGML type ``kind``, the rest F32), as diffusers' ``from_single_file`` reads them: the
    checkpoint's path."""
    import gguf
    import numpy as np

    tr.save_config(folder)
    path = os.path.join(folder, "transformer.gguf")
    block = gguf.GGML_QUANT_SIZES[kind][0]
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, p in tr.state_dict().items():
        if p.ndim == 2 and in_blocks(key) and p.shape[-1] % block == 0:
            if kind == gguf.GGMLQuantizationType.Q8_0:
                writer.add_tensor(key, q8_0(p), raw_dtype=kind)
            else:
                writer.add_tensor(key, gguf.quants.quantize(p.float().cpu().numpy(), kind), raw_dtype=kind)
        else:
            writer.add_tensor(key, p.float().cpu().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q8_0(w: torch.Tensor):
    """``gguf.quants.quantize(w, Q8_0)``'s bytes, computed with torch where ``w`` lives (a 12B model's
    linears in seconds on a GPU instead of minutes of numpy on the host): per block of 32, ``d =
    max|x| / 127`` and ``round(x * (1 / d))`` half away from zero, all in fp32 as gguf-py (and ggml)
    do, then ``d`` as fp16 and the 32 int8s."""
    blocks = w.detach().float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = blocks * inv
    a = v.abs()
    whole = a.floor()
    q = torch.sign(v) * (whole + (2 * (a - whole)).floor())
    out = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
    return out.reshape(w.shape[0], -1).cpu().numpy()


def load_gguf(cls, path: str, folder: str):
    """A ``cls`` transformer from the GGUF checkpoint :func:`write_gguf` wrote, through diffusers'
    GGUF path (``from_single_file`` + ``GGUFQuantizationConfig``, bf16 compute)."""
    from diffusers import GGUFQuantizationConfig

    return cls.from_single_file(path, config=folder, torch_dtype=torch.bfloat16, local_files_only=True,
                                quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16))


def to_nf4(tr):
    """``tr`` with the blocks' linear layers replaced by bitsandbytes' 4-bit NF4 layers holding the
    same weights, quantized where the layer lives, bf16 compute: the modules diffusers'
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` loads (its loader wants a
    GPU; this runs on the CPU too)."""
    import bitsandbytes as bnb

    for parent_name, parent in list(tr.named_modules()):
        for name, layer in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(layer) is not torch.nn.Linear or not in_blocks(full):
                continue
            q = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False, quant_type="nf4")
            q.bias = layer.bias
            setattr(parent, name, q.to(layer.weight.device))  # (the move quantizes)
    return tr
