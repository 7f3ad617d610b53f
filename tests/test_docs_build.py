"""The documentation site builds with warnings as errors (about 10 s) and its pages render.
Skipped where the ``docs`` extra (Sphinx) is not installed; the browser check is skipped where
Debian's ``chromium`` is not installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("sphinx_gallery")
    out = tmp_path_factory.mktemp("html")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-E"]
    result = subprocess.run(
        [*cmd, str(ROOT / "docs"), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_site_builds_with_api_reference_and_gallery(site):
    for page in ("index", "getting_started", "glossary", "conventions", "optim", "api"):
        assert (site / f"{page}.html").exists(), page
    api = (site / "api.html").read_text()
    for name in ("curvopt.extend", "curvopt.collect", "curvopt.optim.KFAC", "curvopt.linalg.GGN"):
        assert name in api, name
    gallery = site / "auto_examples" / "plot_per_sample_norms.html"
    assert "largest relative difference" in gallery.read_text()
    assert list((site / "_images").glob("sphx_glr_plot_*.png")), "the gallery's figures"


def test_internal_links_resolve(site):
    for page in site.rglob("*.html"):
        for href in re.findall(r'href="([^"#:]+\.html)(?:#[^"]*)?"', page.read_text()):
            assert (page.parent / href).resolve().exists(), (page.name, href)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium not installed")
def test_pages_render_in_headless_chromium(site, tmp_path):
    for page in ("index.html", "auto_examples/plot_per_sample_norms.html"):
        shot = tmp_path / (Path(page).stem + ".png")
        subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
             f"--screenshot={shot}", "--window-size=1200,900", (site / page).as_uri()],
            capture_output=True, timeout=120, check=True,
        )
        assert shot.exists() and shot.stat().st_size > 10_000, page
        dom = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
             (site / page).as_uri()],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout
        assert "<title>" in dom and "curvopt" in dom, page
