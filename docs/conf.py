"""Sphinx configuration of curvopt's documentation (``make docs``; builds offline)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

project = "curvopt"
author = "the curvopt developers"
copyright = "the curvopt developers"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "gallery/README.txt", "auto_examples/*.ipynb", "**.zip"]

# Markdown: GitHub-style heading anchors (``conventions.md#models-in-training-mode``).
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

# API reference from the docstrings.
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The docstrings of curvopt/ are prose written for `help()`, not all valid reStructuredText,
# and they name private classes in cross-references. Those warnings are suppressed explicitly
# (and only those): docstring formatting (docutils), unresolved Python cross-references, and
# the links of pages to files outside docs/ (the README, the results' README), which GitHub
# renders and Sphinx cannot.
nitpicky = False
suppress_warnings = [
    "docutils",
    "ref.python",
    "ref.ref",
    "myst.xref_missing",
    "autodoc.import_object",
]

# The gallery: small scripts executed at build time, their figures shown.
sphinx_gallery_conf = {
    "examples_dirs": "gallery",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "plot_gallery": "True",
}

# Furo, as many scientific Python projects; its content column widened so that a code block of
# 100-character lines (the project's line length) fits without a scroll bar (``_static``).
html_theme = "furo"
html_title = "curvopt"
html_static_path = ["_static"]
html_css_files = ["wide_code.css"]
