import hashlib
import math

import numpy as np
import pytest
import torch
from PIL import Image

from exactdit.harness import metrics


def test_md5_tensor_is_md5_of_raw_bytes():
    assert metrics.md5_tensor(torch.tensor([1.0], dtype=torch.bfloat16)) == hashlib.md5(b"\x80\x3f").hexdigest()
    assert metrics.md5_tensor(torch.tensor([1.0], dtype=torch.float32)) == hashlib.md5(b"\x00\x00\x80\x3f").hexdigest()
    # non-contiguous views hash their logical contents
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert metrics.md5_tensor(t.t()) == metrics.md5_tensor(t.t().contiguous())
    assert metrics.md5_tensor(t) != metrics.md5_tensor(t.t().contiguous())


def test_md5_tensor_sees_one_ulp():
    a = torch.ones(64, dtype=torch.float16)
    b = a.clone()
    b.view(torch.int16)[17] += 1  # flip the lowest mantissa bit: 1.0 -> 1.0 + 2^-10
    assert metrics.md5_tensor(a) != metrics.md5_tensor(b)
    assert metrics.max_abs(a, b) == pytest.approx(2.0**-10)


def test_md5_image_is_md5_of_pixels():
    arr = np.zeros((2, 3, 3), np.uint8)
    arr[1, 2] = (1, 2, 3)
    assert metrics.md5_image(Image.fromarray(arr)) == hashlib.md5(arr.tobytes()).hexdigest()
    assert metrics.md5_image(arr) == metrics.md5_image(Image.fromarray(arr))


def test_psnr_known_values():
    a = np.full((16, 16, 3), 100, np.uint8)
    b = a + 1  # MSE = 1 -> 10 * log10(255^2)
    assert metrics.psnr(a, b) == pytest.approx(20 * math.log10(255.0), abs=1e-9)
    assert metrics.psnr(a, a) == math.inf
    c = a.copy()
    c[0, 0, 0] += 16  # MSE = 256 / 768
    assert metrics.psnr(a, c) == pytest.approx(10 * math.log10(255.0**2 / (256 / 768)), abs=1e-9)
    # float images use data_range 1.0
    f = np.zeros((8, 8, 1))
    assert metrics.psnr(f, f + 0.1) == pytest.approx(20.0, abs=1e-9)


def test_ssim_known_values():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    assert metrics.ssim(a, a) == pytest.approx(1.0)
    # constant images: SSIM reduces to the luminance term (2*mu_a*mu_b + C1) / (mu_a^2 + mu_b^2 + C1)
    x = np.full((16, 16, 3), 100, np.uint8)
    y = np.full((16, 16, 3), 101, np.uint8)
    c1 = (0.01 * 255) ** 2
    expected = (2 * 100 * 101 + c1) / (100**2 + 101**2 + c1)
    assert metrics.ssim(x, y) == pytest.approx(expected, rel=1e-9)
    # an inverted image is strongly dissimilar
    assert metrics.ssim(a, 255 - a) < 0


def test_ssim_tiny_images_do_not_crash():
    a = np.zeros((4, 5, 3), np.uint8)
    assert metrics.ssim(a, a) == pytest.approx(1.0)


def test_max_abs_and_shape_checks():
    a = torch.zeros(2, 3)
    b = a.clone()
    b[1, 2] = -0.5
    assert metrics.max_abs(a, b) == 0.5
    assert metrics.compare_tensors(a, a)["equal"] is True
    assert metrics.compare_tensors(a, b)["equal"] is False
    with pytest.raises(ValueError):
        metrics.max_abs(a, torch.zeros(3, 2))
    img = np.zeros((4, 4, 3), np.uint8)
    img2 = img.copy()
    img2[0, 0, 1] = 7
    rep = metrics.compare_images(img, img2)
    assert rep["max_abs"] == 7 and rep["equal"] is False and rep["psnr_db"] < math.inf
