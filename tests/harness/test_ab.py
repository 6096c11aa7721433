import json

import numpy as np
import torch

from exactdit.harness import ab


def test_side_by_side_layout_and_diff_amplification():
    a = np.zeros((8, 8, 3), np.uint8)
    b = a.copy()
    b[2, 3] = (0, 4, 0)  # diff of 4 -> amplified to 255
    d, gain = ab.diff_image(a, b)
    assert gain == 255 / 4 and d[2, 3].tolist() == [255, 255, 255] and d.sum() == 255 * 3
    img = ab.side_by_side(a, b, min_size=16)
    assert img.size == (3 * 16 + 2 * 4, 16 + 14)
    # identical inputs -> black diff tile, no amplification
    d0, g0 = ab.diff_image(a, a)
    assert g0 == 1.0 and d0.max() == 0


def test_latent_preview_shares_scale():
    lat = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    x = ab.latent_rgb(lat)
    assert x.shape == (4, 4, 3) and x.dtype == np.uint8 and x.min() == 0 and x.max() == 255
    img = ab.latent_side_by_side(lat, lat + 0.5)
    assert img.size[0] > img.size[1]


def test_report_verdicts_and_files(tmp_path):
    lat = torch.randn(1, 4, 4, 4)
    imgs = [np.full((8, 8, 3), 10, np.uint8)]
    other = [imgs[0].copy()]
    other[0][0, 0, 0] = 11
    base = {"latents": lat, "images": imgs}
    same = {"latents": lat.clone(), "images": [imgs[0].copy()]}
    diff = {"latents": lat + 1e-3, "images": other}

    rep = ab.build_report(base, same, repeat=same)
    assert rep["verdict"] == "EQUAL" and rep["baseline_deterministic"] is True
    rep = ab.build_report(base, diff, repeat=same)
    assert rep["verdict"] == "DIFFERENT"
    assert rep["patched_vs_baseline"]["images"][0]["max_abs"] == 1.0

    written = ab.write_report(tmp_path, base, diff, repeat=same, meta={"prompt": "p"})
    for f in written["files"]:
        assert (tmp_path / f).is_file(), f
    data = json.loads((tmp_path / "ab_report.json").read_text())
    assert data["verdict"] == "DIFFERENT"
    assert data["baseline_vs_repeat"]["images"][0]["psnr_db"] == "inf"
    md = (tmp_path / "ab_report.md").read_text()
    assert "DIFFERENT" in md and "determinism" in md and "| image 0 |" in md
