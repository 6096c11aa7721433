"""A/B reports: baseline (eager) vs patched, plus a baseline-vs-baseline repeat for determinism.

Writes ``ab_report.json``, ``ab_report.md`` and side-by-side PNGs (baseline | patched | amplified
absolute difference) for images and/or latents.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from . import metrics
from .perf import write_json


# ------------------------------------------------------------------------------------------ images


def _to_uint8_rgb(img) -> np.ndarray:
    arr = metrics.image_array(img)
    if arr.dtype != np.uint8:
        arr = np.clip(np.rint(arr.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return arr[..., :3]


def diff_image(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """Absolute difference amplified so the largest difference maps to 255; returns (image, gain)."""
    d = np.abs(a.astype(np.int32) - b.astype(np.int32)).max(axis=-1)
    peak = int(d.max()) if d.size else 0
    gain = 255.0 / peak if peak else 1.0
    out = np.clip(np.rint(d * gain), 0, 255).astype(np.uint8)
    return np.repeat(out[..., None], 3, axis=-1), gain


def compose(tiles: Sequence[np.ndarray], captions: Sequence[str], min_size: int = 128):
    """Equal-size HxWx3 uint8 tiles placed left to right (nearest-upscaled to >= ``min_size``) under captions."""
    from PIL import Image, ImageDraw

    h, w = tiles[0].shape[:2]
    scale = max(1, math.ceil(min_size / max(1, min(h, w))))
    imgs = [Image.fromarray(t).resize((w * scale, h * scale), Image.NEAREST) for t in tiles]
    tw, th = imgs[0].size
    gap, cap = 4, 14
    canvas = Image.new("RGB", (len(imgs) * tw + (len(imgs) - 1) * gap, th + cap), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (tile, text) in enumerate(zip(imgs, captions)):
        x = i * (tw + gap)
        canvas.paste(tile, (x, cap))
        draw.text((x + 2, 1), text, fill=(0, 0, 0))
    return canvas


def side_by_side(baseline, patched, *, labels: Sequence[str] = ("baseline", "patched", "|diff|"), min_size: int = 128):
    """PIL image: baseline | patched | absolute difference amplified so its maximum is white."""
    a, b = _to_uint8_rgb(baseline), _to_uint8_rgb(patched)
    if a.shape != b.shape:
        raise ValueError(f"image shapes differ: {a.shape} vs {b.shape}")
    d, gain = diff_image(a, b)
    third = labels[2] + (f" x{gain:.0f}" if gain != 1.0 else " (none)")
    return compose([a, b, d], [labels[0], labels[1], third], min_size=min_size)


# ----------------------------------------------------------------------------------------- latents

def latent_rgb(latents: torch.Tensor, ref: torch.Tensor | None = None) -> np.ndarray:
    """First sample of [B, C, H, W] latents as HxWx3 uint8: fixed random projection C -> 3, then per-channel
    min/max normalisation computed on ``ref`` (default: the latents themselves) so two previews share a scale."""
    lat = latents.detach().cpu().double()[0]
    ref = lat if ref is None else ref.detach().cpu().double()[0]
    proj = torch.randn((3, lat.shape[0]), generator=torch.Generator("cpu").manual_seed(1234), dtype=torch.float64)
    rgb, rref = torch.einsum("kc,chw->khw", proj, lat), torch.einsum("kc,chw->khw", proj, ref)
    lo, hi = rref.amin(dim=(1, 2), keepdim=True), rref.amax(dim=(1, 2), keepdim=True)
    rgb = (rgb - lo) / (hi - lo).clamp_min(1e-12)
    return (rgb.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def latent_side_by_side(baseline: torch.Tensor, patched: torch.Tensor, labels=("eager", "patched", "|diff|")):
    """Preview of two latent tensors: both projected with the baseline's scale, then |a - b| (max over
    channels) amplified so its maximum is white."""
    a = latent_rgb(baseline, ref=baseline)
    b = latent_rgb(patched, ref=baseline)
    d = (baseline.detach().cpu().double()[0] - patched.detach().cpu().double()[0]).abs().amax(dim=0)
    peak = float(d.max()) if d.numel() else 0.0
    dimg = (d / peak * 255).round().to(torch.uint8).numpy() if peak > 0 else np.zeros(tuple(d.shape), np.uint8)
    dimg = np.repeat(dimg[..., None], 3, axis=-1)
    return compose([a, b, dimg], [labels[0], labels[1], f"{labels[2]} max {peak:.3g}"])


# ------------------------------------------------------------------------------------------ report


def compare_run(base: dict, other: dict) -> dict:
    """``base`` / ``other``: {"latents": Tensor | None, "images": [PIL] | None}."""
    out: dict[str, Any] = {}
    if base.get("latents") is not None and other.get("latents") is not None:
        out["latents"] = metrics.compare_tensors(base["latents"], other["latents"])
    imgs_a, imgs_b = base.get("images") or [], other.get("images") or []
    if imgs_a and imgs_b:
        out["images"] = [metrics.compare_images(x, y) for x, y in zip(imgs_a, imgs_b)]
    parts = [out["latents"]["equal"]] if "latents" in out else []
    parts += [c["equal"] for c in out.get("images", [])]
    out["equal"] = bool(parts) and all(parts)
    return out


def build_report(baseline: dict, patched: dict, repeat: dict | None = None, meta: dict | None = None) -> dict:
    rep: dict[str, Any] = {"meta": dict(meta or {}), "patched_vs_baseline": compare_run(baseline, patched)}
    if repeat is not None:
        rep["baseline_vs_repeat"] = compare_run(baseline, repeat)
        rep["baseline_deterministic"] = rep["baseline_vs_repeat"]["equal"]
    rep["verdict"] = "EQUAL" if rep["patched_vs_baseline"]["equal"] else "DIFFERENT"
    return rep


def fmt(v) -> str:
    """A metric for the reports: floats to 6 significant digits, inf and nan by name."""
    if isinstance(v, float):
        return "inf" if math.isinf(v) else "nan" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def report_markdown(rep: dict) -> str:
    lines = [f"# exactdit A/B report: **{rep['verdict']}**", ""]
    for k, v in rep.get("meta", {}).items():
        lines.append(f"- {k}: {v}")
    sections = [("patched vs baseline", rep["patched_vs_baseline"])]
    if "baseline_vs_repeat" in rep:
        sections.append(("baseline vs baseline repeat (determinism)", rep["baseline_vs_repeat"]))
    for title, cmp in sections:
        lines += ["", f"## {title}: {'EQUAL' if cmp['equal'] else 'DIFFERENT'}", ""]
        lines += ["| what | md5 A | md5 B | equal | max_abs | PSNR (dB) | SSIM |", "|---|---|---|---|---|---|---|"]
        if "latents" in cmp:
            c = cmp["latents"]
            lines.append(f"| latents | `{c['md5_a']}` | `{c['md5_b']}` | {c['equal']} | {fmt(c['max_abs'])} | | |")
        for i, c in enumerate(cmp.get("images", [])):
            lines.append(f"| image {i} | `{c['md5_a']}` | `{c['md5_b']}` | {c['equal']} | {fmt(c['max_abs'])} "
                         f"| {fmt(c['psnr_db'])} | {fmt(c['ssim'])} |")
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, baseline: dict, patched: dict, repeat: dict | None = None,
                 meta: dict | None = None) -> dict:
    """Write ab_report.json / ab_report.md / side-by-side PNGs into ``out_dir``; returns the report dict
    (with a "files" entry listing what was written)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = build_report(baseline, patched, repeat, meta)
    files = []
    for i, (x, y) in enumerate(zip(baseline.get("images") or [], patched.get("images") or [])):
        p = out / f"ab_side_by_side_{i}.png"
        side_by_side(x, y, labels=("baseline (eager)", "patched", "|diff|")).save(p)
        files.append(p.name)
    if baseline.get("latents") is not None and patched.get("latents") is not None:
        p = out / "ab_latents_side_by_side.png"
        latent_side_by_side(baseline["latents"], patched["latents"]).save(p)
        files.append(p.name)
    rep["files"] = files + ["ab_report.json", "ab_report.md"]
    write_json(out / "ab_report.json", rep)
    (out / "ab_report.md").write_text(report_markdown(rep))
    return rep
