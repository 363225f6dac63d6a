"""Sphinx configuration of jax_blink's documentation: MyST Markdown pages, an API reference from
Google-style docstrings (autodoc + napoleon). Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``."""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
# Importing jax_blink imports jax: keep the build on CPU and quiet on machines with a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jax_blink"
author = "jax_blink authors"
copyright = "2026, jax_blink authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}

html_theme = "furo"
html_title = "jax_blink"
