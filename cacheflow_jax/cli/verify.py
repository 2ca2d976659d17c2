"""``cacheflow verify``: record, or check, the chunk manifest of an orbax checkpoint."""

from __future__ import annotations

import argparse
import json

from cacheflow_jax.cli.common import check_store_location, human_size


def cmd_verify(args: argparse.Namespace) -> int:
    """Records (or checks) the chunk manifest of an orbax checkpoint; 1 if a chunk is bad."""
    from cacheflow_jax.store.verify import verify_checkpoint

    check_store_location(args.path, what="checkpoint")
    report = verify_checkpoint(args.path, step=args.step, update=args.update)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        what = {
            "recorded": "recorded the CRC-32C of every chunk in",
            "ok": "every chunk matches",
            "corrupt": "DAMAGED chunks; manifest",
        }[report["status"]]
        print(
            f"{report['checkpoint']}: {report['arrays']} arrays, {report['chunks']} chunks, "
            f"{human_size(report['nbytes'])}: {what} {report['manifest']}"
        )
        for err in report["errors"]:
            print(f"  {err}")
        if report["removed"]:
            print(
                f"removed {len(report['removed'])} manifest(s) of steps the CheckpointManager "
                f"deleted: {', '.join(report['removed'])}"
            )
    return 1 if report["status"] == "corrupt" else 0
