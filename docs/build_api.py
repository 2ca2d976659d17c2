"""Builds the API reference (HTML, generated from the docstrings) and checks it is complete.

Run from the repository root (needs the ``docs`` or ``test`` extra, which bring pdoc):

    python docs/build_api.py [OUT]        # default OUT: build/api; open OUT/index.html

It renders the public modules with pdoc (Google-style docstrings), then checks that every public
name (each module's ``__all__``) has its own entry in the rendered pages, and exits with status 1
naming any that is missing. ``tests/test_docs.py`` runs it, so CI checks the build.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Document this checkout's packages, not whatever an editable install elsewhere points to.
sys.path.insert(0, str(ROOT))

# The public modules: the library's surface, its metrics helper, the orbax hook, the predictor
# package and the kernels package. Private modules (leading underscore) are documented through
# the names these re-export.
# (``cacheflow_jax.orbax`` is in ``cacheflow_jax.__all__``, so it gets its page from there.)
MODULES = ("cacheflow_jax", "cacheflow_jax.metrics", "predictor", "pallas_kernels")
CHECKED = (*MODULES, "cacheflow_jax.orbax")


def public_names(module_name: str) -> list[str]:
    """The names a module makes public: its ``__all__``, or its non-underscore attributes."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", module_name) == module_name
        ]  # fmt: skip
    return sorted(names)


def build(out: Path) -> list[str]:
    """Renders the reference into ``out``; returns the public names that have no entry."""
    import warnings

    import pdoc
    import pdoc.render

    # Annotations that name typing helpers imported only for type checkers cannot be resolved
    # at run time; pdoc then prints them as written, which is what a reader needs anyway.
    warnings.filterwarnings("ignore", message="Error parsing type annotation")

    pdoc.render.configure(docformat="google", footer_text="cacheflow-jax API reference")
    pdoc.pdoc(*MODULES, output_directory=out)
    missing = []
    for name in CHECKED:
        page = out / (name.replace(".", "/") + ".html")
        if not page.is_file():
            missing.append(f"{name} (no page {page})")
            continue
        html = page.read_text(encoding="utf-8")
        ids = set(re.findall(r'id="([^"]+)"', html))
        for public in public_names(name):
            submodule = out / name.replace(".", "/") / f"{public}.html"
            if public not in ids and f"{name}.{public}" not in ids and not submodule.is_file():
                missing.append(f"{name}.{public}")
    return missing


def main(argv: list[str] | None = None) -> int:
    """Builds into ``argv[0]`` (default ``build/api``); returns 0, or 1 if a name is missing."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "build/api")
    missing = build(out)
    if missing:
        print(f"API reference in {out} lacks: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"API reference: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
