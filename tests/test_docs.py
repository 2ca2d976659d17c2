"""The API reference builds from the docstrings and lists every public name (CI runs this)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_builds_and_lists_every_public_name(tmp_path: Path) -> None:
    out = tmp_path / "api"
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build_api.py"), str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lacks" not in done.stderr
    index = out / "cacheflow_jax.html"
    html = index.read_text()
    for name in ("TieredCache", "serving", "open_store", "write_store", "lfu", "BudgetError"):
        assert f'id="{name}"' in html, name
    # Docstrings are rendered (RST literals as code, Google-style Args as a list), not raw text.
    assert 'a policy name (<code>"lfu"</code>' in html
    assert "<li><strong>device_bytes:</strong>" in html
    metrics = (out / "cacheflow_jax" / "metrics.html").read_text()
    assert 'id="serve"' in metrics and "cacheflow_l3_read_seconds_total" in metrics
    assert (out / "predictor.html").is_file() and (out / "cacheflow_jax" / "orbax.html").is_file()
