"""The documentation site builds with warnings as errors (about a minute: the gallery's eight
examples run) in the Furo theme, and its pages render in a headless browser with no code block
clipped. Skipped where the ``docs`` extra (Sphinx) is not installed; the browser checks are
skipped, saying how to install it, where Debian's ``chromium`` is not."""

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


def test_the_site_is_themed_and_the_gallery_has_eight_executed_examples(site):
    assert "furo" in (site / "index.html").read_text().lower()
    examples = sorted((ROOT / "docs" / "gallery").glob("plot_*.py"))
    assert len(examples) >= 8
    for example in examples:
        page = site / "auto_examples" / f"{example.stem}.html"
        assert page.exists(), example.name
        figures = list((site / "_images").glob(f"sphx_glr_{example.stem}_*.png"))
        assert [f for f in figures if "thumb" not in f.name], f"{example.name} drew no figure"


def _output(site: Path, example: str) -> str:
    """The printed output of a gallery example, as its page shows it."""
    page = (site / "auto_examples" / f"{example}.html").read_text()
    blocks = re.findall(r"sphx-glr-script-out[^>]*>(?:<div[^>]*>)?<pre>(.*?)</pre>", page, re.S)
    return "\n".join(re.sub(r"<[^>]+>", "", block) for block in blocks)


def _number(text: str, before: str) -> float:
    return float(re.search(re.escape(before) + r"\s*([-\d.e]+)", text)[1])


def test_the_gallery_checks_agree_with_their_references(site):
    """What the examples print against a plain reference (a loop over samples, the data's
    second moment) agrees, in float32."""
    assert _number(_output(site, "plot_dp_sgd_clipping"), "to the loop:") < 1e-5
    noise = _output(site, "plot_gradient_noise_scale")
    tr_sigma, loop = re.search(
        r"tr Σ: ([\d.]+) from Variance, ([\d.]+) from the loop", noise
    ).groups()
    assert tr_sigma == loop
    assert _number(_output(site, "plot_kronecker_factors"), "Xᵀ X / N:") < 1e-5
    assert 0 < _number(_output(site, "plot_kronecker_factors"), "relative error of B ⊗ A:") < 1


def test_internal_links_resolve(site):
    for page in site.rglob("*.html"):
        for href in re.findall(r'href="([^"#:]+\.html)(?:#[^"]*)?"', page.read_text()):
            assert (page.parent / href).resolve().exists(), (page.name, href)


CHROMIUM = pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="Debian's chromium is not installed: `make browser` (as root) installs it",
)

#: the pages the browser checks: the index, the optimizers' reference and three gallery pages
PAGES = (
    "index.html",
    "optim.html",
    "auto_examples/plot_optimizer_swap_digits.html",
    "auto_examples/plot_compare_curvature.html",
    "auto_examples/plot_laplace_uncertainty.html",
)

#: run at load: for every <pre>, "scrollWidth,clientWidth" into <div id="probe"> (a clipped
#: block scrolls: its content is wider than its box)
_PROBE = """<script>
window.addEventListener("load", () => {
  const widths = [...document.querySelectorAll("pre")].map(
    (pre) => pre.scrollWidth + "," + pre.clientWidth);
  const probe = document.createElement("div");
  probe.id = "probe";
  probe.textContent = widths.join(";");
  document.body.appendChild(probe);
});
</script>"""


def _chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout, check=True
    )


@CHROMIUM
@pytest.mark.parametrize("page", PAGES)
def test_page_renders_with_no_code_block_clipped(site, page, tmp_path):
    """The page renders (a screenshot, its title), and at a laptop's width (1400 px) no code
    block is wider than its box: 100-character lines fit without a scroll bar."""
    shot = tmp_path / "page.png"
    _chromium(f"--screenshot={shot}", (site / page).as_uri())
    assert shot.exists() and shot.stat().st_size > 10_000, page
    probed = (site / page).with_name(f"probe_{Path(page).name}")
    probed.write_text((site / page).read_text().replace("</body>", _PROBE + "</body>"))
    dom = _chromium("--virtual-time-budget=5000", "--dump-dom", probed.as_uri()).stdout
    assert "<title>" in dom and "curvopt" in dom, page
    (widths,) = re.findall(r'<div id="probe">([^<]*)</div>', dom)
    blocks = [tuple(map(int, pair.split(","))) for pair in widths.split(";") if pair]
    if page != "index.html":
        assert blocks, f"{page} shows no code"
    clipped = [(scroll, box) for scroll, box in blocks if scroll > box]
    assert not clipped, (page, clipped)
