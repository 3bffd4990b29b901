"""Sphinx configuration: the API reference from the docstrings (autodoc), the guides from docs/*.md (MyST).

Build with ``make docs`` (HTML in docs/_build/html).  ``nitpicky`` and ``-W`` make every cross-reference
that points at no documented name an error, so renaming a function without its references fails the build.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # build from a checkout without installing (make docs installs anyway)

import attnkit  # noqa: E402

project = "attnkit"
author = "the attnkit authors"
copyright = "2026, the attnkit authors"
release = version = attnkit.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "examples"]
root_doc = "index"

# docstrings are Google style ("Args:", "Returns:")
napoleon_google_docstring = True
napoleon_numpy_docstring = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

# a reference to a name that does not exist is an error (with -W)
nitpicky = True
# names outside attnkit: PyTorch's and the standard library's documentation is not linked (no network at build
# time), so their types in signatures are taken as they are
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|collections|dataclasses|enum|argparse|pathlib|transformers|triton|numpy)(\..*)?"),
    (r"py:class", r"(Tensor|Module|nn\.Module|Callable|Sequence|Iterable|Iterator|Path|Any|BlockMask)"),
    (r"py:class", r"(int|float|str|bool|bytes|dict|list|tuple|set|object|None|type)"),
    # Sphinx splits a dataclass field's `list[tuple[int, float]]` type at the comma
    (r"py:class", r"list\[tuple\[int"),
]
# returned by PagedSinkCache.batch()/packed(), used through the PagedBatch/PagedPacked interface, not exported
nitpick_ignore = [
    ("py:class", "os.PathLike"),
    ("py:class", "starlette.applications.Starlette"),
    ("py:class", "attnkit.cache.sink.PagedSinkBatch"),
    ("py:class", "attnkit.cache.sink.PagedSinkPacked"),
    # returned by attnkit.nn.decode_products(): printed or read through .choices, not exported
    ("py:class", "DecodeProducts"),
    ("py:class", "attnkit.nn._products.DecodeProducts"),
]

# BENCHMARKS.md sits beside docs/, outside Sphinx's sources: the guides' links to it go to its copy as a page
# of the build (docs/benchmarks.rst includes it)
_BENCHMARKS_LINK = re.compile(r"\]\(\.\./BENCHMARKS\.md(#[^)]*)?\)")


def _link_benchmarks(app, docname, source):
    source[0] = _BENCHMARKS_LINK.sub("](benchmarks.rst)", source[0])


def setup(app):
    app.connect("source-read", _link_benchmarks)


myst_heading_anchors = 3
html_theme = "alabaster"
html_title = f"attnkit {release}"
