"""python -m reco.cli.export_triton --variant DIR --out DIR [--name NAME] [key=value ...]

Writes an ONNX Runtime variant as a Triton Inference Server model repository (reco/export/triton.py):
OUT/NAME/config.pbtxt and OUT/NAME/1/model.onnx. The settings are conf/export/triton.yaml (keys of
`export.triton`), which follow how reco serves the variant (conf/serve/default.yaml); `serve.<key>=...`
overrides set the serving they follow (e.g. serve.batching.max_batch=1024), other `key=value` pairs are
export.triton keys (e.g. max_batch_size=2048). Prints the written config.pbtxt; exit 2 with the reason on
stderr when the variant or the settings cannot be exported.
"""

from __future__ import annotations

import argparse
import sys

from reco.cli.compose import compose
from reco.cli.errors import exits_cleanly
from reco.config import typed
from reco.export.triton import VERSION, TritonExportConfig, write_model_repository
from reco.variant import Variant


def settings(variant: Variant, overrides: list[str]) -> TritonExportConfig:
    """conf/export/triton.yaml with a (legacy) variant's runtime.batching applied to serve.batching, as
    reco's server applies it, then `overrides` (`serve.<key>=...` as such, others as export.triton keys)."""
    served = [f"serve.batching.{k}={val}" for k, val in variant.runtime.get("batching", {}).items()]
    keys = [o if o.startswith("serve.") else f"export.triton.{o}" for o in overrides]
    return typed(compose([*served, *keys]).export.triton, TritonExportConfig, "export.triton")


@exits_cleanly("reco.export.triton: cannot export")
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m reco.cli.export_triton",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--variant", required=True, help="variant directory (holds variant.json); backend onnxruntime"
    )
    p.add_argument(
        "--out", required=True, help="Triton model repository directory; the model goes to OUT/NAME/"
    )
    p.add_argument("--name", help="Triton model name (default: the variant's name)")
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value overrides of export.triton (conf/export/triton.yaml), e.g. max_batch_size=2048",
    )
    args = p.parse_args(argv)
    cfg = settings(Variant.load(args.variant), args.overrides)
    model_dir = write_model_repository(args.variant, args.out, args.name, cfg)
    print(f"# {model_dir / 'config.pbtxt'} (model: {model_dir / VERSION / 'model.onnx'})")
    print((model_dir / "config.pbtxt").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
