"""Exactness metrics: md5 of tensors / images, max_abs, PSNR and SSIM (scikit-image)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch


def md5_tensor(t: torch.Tensor) -> str:
    """md5 of the tensor's raw bytes in its own dtype (bf16/fp16 included), C-contiguous: same md5 <=>
    bit-identical tensors of the same dtype and numel."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return hashlib.md5(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def outputs_equal(a, b) -> bool:
    """``torch.equal`` of two results: tensors, or (nested) tuples / lists of them (Z-Image returns
    a list per image)."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(outputs_equal(x, y) for x, y in zip(a, b)))
    return bool(torch.equal(a, b))


def image_array(img) -> np.ndarray:
    """A PIL image / numpy array / [C,H,W] or [H,W,C] tensor as an HxWxC uint8 (or float) array."""
    if isinstance(img, np.ndarray):
        arr = img
    elif isinstance(img, torch.Tensor):
        arr = img.detach().cpu().numpy()
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = np.moveaxis(arr, 0, -1)
    else:  # PIL
        arr = np.asarray(img.convert("RGB") if getattr(img, "mode", "RGB") not in ("RGB", "L") else img)
    return arr[..., None] if arr.ndim == 2 else arr


def md5_image(img) -> str:
    """md5 of the decoded pixels (not of the PNG container)."""
    return hashlib.md5(np.ascontiguousarray(image_array(img)).tobytes()).hexdigest()


def _pair(a, b, data_range: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Two images as arrays of one shape, and their data range (uint8: 255, floats: 1.0)."""
    x, y = image_array(a), image_array(b)
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: {x.shape} vs {y.shape}")
    return x, y, float(data_range if data_range is not None else 255.0 if x.dtype == np.uint8 else 1.0)


def max_abs(a, b) -> float:
    """max |a - b| computed in float64 (a, b: tensors, arrays or PIL images of the same shape)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
        if a.numel() == 0:
            return 0.0
        return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())
    x, y, _ = _pair(a, b)
    return float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) if x.size else 0.0


def psnr(a, b, data_range: float | None = None) -> float:
    """PSNR in dB (``inf`` for identical images). uint8 images use data_range 255, floats 1.0."""
    from skimage.metrics import peak_signal_noise_ratio

    x, y, dr = _pair(a, b, data_range)
    if np.array_equal(x, y):
        return math.inf
    return float(peak_signal_noise_ratio(x.astype(np.float64), y.astype(np.float64), data_range=dr))


def ssim(a, b, data_range: float | None = None) -> float:
    """Mean SSIM over channels (scikit-image, 7x7 Gaussian-free window, shrunk for tiny images)."""
    from skimage.metrics import structural_similarity

    x, y, dr = _pair(a, b, data_range)
    side = min(x.shape[0], x.shape[1])
    if side < 3:
        return 1.0 if np.array_equal(x, y) else float("nan")
    win = min(7, side if side % 2 == 1 else side - 1)
    return float(structural_similarity(x.astype(np.float64), y.astype(np.float64), data_range=dr, channel_axis=-1,
                                       win_size=win))


def compare_images(a, b) -> dict:
    md5_a, md5_b = md5_image(a), md5_image(b)
    return {"md5_a": md5_a, "md5_b": md5_b, "equal": md5_a == md5_b and image_array(a).shape == image_array(b).shape,
            "max_abs": max_abs(a, b), "psnr_db": psnr(a, b), "ssim": ssim(a, b)}


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"md5_a": md5_tensor(a), "md5_b": md5_tensor(b),
            "equal": bool(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())),
            "max_abs": max_abs(a, b)}
